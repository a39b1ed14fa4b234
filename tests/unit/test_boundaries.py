"""The package's architecture, checked: vLLM is imported only in hybrid_rl/rollout/, and no
module imports from a higher layer (lazy imports inside functions count too)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hybrid_rl"

# Bottom to top. A module may import its own layer's modules or lower ones (never in a cycle:
# the registry's self-filling import is the one allowed exception, inside algorithms/).
LAYERS = [
    {"errors", "batch", "timing", "faults", "env", "dist", "launch", "resume"},
    {"rewards", "algorithms"},
    {"engine", "rollout"},
    {"config", "data", "hybrid", "models", "export", "export_lora"},
    {"trainer"},
    {"tasks", "main", "plot"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def unit(path: Path) -> str:
    """The layer unit of a file: its top-level module or folder under hybrid_rl/."""
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


SOURCES = sorted(p for p in PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = {unit(p) for p in SOURCES if unit(p) not in LAYER_OF and unit(p) != "__init__"}
    assert not missing, f"add these to LAYERS: {missing}"


def test_vllm_is_imported_only_in_the_rollout_folder():
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        # the project's own benchmark scripts; not benchmarks/.deps (TRL installed there by vs_trl)
        for p in [*SOURCES, *(ROOT / "benchmarks").glob("*.py")]
        for line, mod in imports(p)
        if (mod == "vllm" or mod.startswith("vllm.")) and (PKG not in p.parents or unit(p) != "rollout")
    ]
    assert not offenders, f"vllm imported outside hybrid_rl/rollout/: {offenders}"


def test_no_import_from_a_higher_layer():
    upward = []
    for p in SOURCES:
        here = unit(p)
        if here == "__init__":
            continue
        for line, mod in imports(p):
            if not mod.startswith("hybrid_rl."):
                continue
            there = mod.split(".")[1]
            if LAYER_OF.get(there, -1) > LAYER_OF[here]:
                upward.append(
                    f"{p.relative_to(ROOT)}:{line} ({here}, layer {LAYER_OF[here]}) imports {mod} (layer {LAYER_OF[there]})"
                )
    assert not upward, "\n".join(upward)


def test_no_import_cycles_between_units():
    edges: dict[str, set[str]] = {}
    for p in SOURCES:
        here = unit(p)
        for _, mod in imports(p):
            if mod.startswith("hybrid_rl.") and (there := mod.split(".")[1]) != here and there in LAYER_OF:
                edges.setdefault(here, set()).add(there)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ()))

    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if reaches(b, a, {b})})
    assert not cycles, f"import cycles between units: {cycles}"


def test_no_file_over_400_lines_and_no_function_over_60():
    """The package's size rule (docs/development.md): split when you add, not later."""
    too_long = []
    for p in SOURCES:
        text = p.read_text()
        if len(text.splitlines()) > 400:
            too_long.append(f"{p.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
