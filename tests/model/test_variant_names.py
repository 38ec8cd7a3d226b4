"""What a variant does differently is asked of its Variant (pretrain/variants/) or its model
class, never of its name: no module outside pretrain/variants/ compares anything with a
registered variant's name, nor lists variants by name."""

import ast
from collections.abc import Mapping

from pretrain import PROJECT_ROOT
from pretrain.variants import REGISTRY

PACKAGES = ("pretrain", "launcher", "data_pipeline")
# comparisons with a string that is a variant's name but names something else
NOT_VARIANT_NAMES = {
    ("pretrain/tools/bench/decode.py", "r['strategy'] == 'dense'"): "the strategy label of a model without a loop",
}


def _names_in(node: ast.AST, bound: Mapping[str, ast.AST]) -> set[str]:
    """The registered variant names node stands for: a string constant, a tuple, list or set of
    them, or a module-level name bound to one of those."""
    if isinstance(node, ast.Name) and node.id in bound:
        node = bound[node.id]
    if isinstance(node, ast.Constant) and node.value in REGISTRY:
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        if all(isinstance(e, ast.Constant) and e.value in REGISTRY for e in node.elts):
            return {str(e.value) for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def name_tests(source: str) -> list[str]:
    """Each comparison with a variant's name, and each hand-written list of two or more variants."""
    tree = ast.parse(source)
    bound = {
        t.id: stmt.value
        for stmt in tree.body
        if isinstance(stmt, ast.Assign)
        for t in stmt.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_in(x, bound) for x in [node.left, *node.comparators]):
            found.append(ast.unparse(node))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_names_in(node, {})) >= 2:
            found.append(ast.unparse(node))
    return found


def test_the_check_finds_each_way_of_testing_a_name():
    source = (
        'CACHED = ("grt", "dense")\n'
        'a = cfg.variant == "grt"\n'
        "b = cfg.variant in CACHED\n"
        'c = v not in ["huginn", "mor"]\n'
        'd = {"grt": 1, "dense": 2}.get(name)\n'  # a dict is not a test of the name
        'e = ("grt", "GRT")\n'  # nor a name beside its label
    )
    assert name_tests(source) == [
        "('grt', 'dense')",
        "cfg.variant == 'grt'",
        "cfg.variant in CACHED",
        "v not in ['huginn', 'mor']",
        "['huginn', 'mor']",
    ]


def test_no_module_outside_the_variants_tests_a_variants_name():
    found, exempted = [], set()
    for package in PACKAGES:
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            rel = path.relative_to(PROJECT_ROOT).as_posix()
            if rel.startswith("pretrain/variants/"):
                continue
            for test in name_tests(path.read_text()):
                if (rel, test) in NOT_VARIANT_NAMES:
                    exempted.add((rel, test))
                else:
                    found.append(f"{rel}: {test}")
    assert not found, "ask the Variant or the model class instead:\n" + "\n".join(found)
    assert exempted == set(NOT_VARIANT_NAMES)  # an exemption that matches nothing any more goes
