"""Every field of the configuration tree is read by something: a value that is accepted
and ignored is a defect (implement it or remove it).

The check is static: it reads ``src/`` and looks for a read of each field through a
name that holds its section. A name holds a section when it is a parameter or
attribute annotated with the section's class, the section's own ``self`` (in a method
other than its validation), or is assigned from an expression ending in the section's
name in the tree (``algo = cfg.algorithm``); ``a.rollout.tp`` is a read of ``tp`` of
the rollout section. Reads inside a section's ``__post_init__`` (validation) do not
count.
"""

import ast
from pathlib import Path

import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.sim.config import SimulatedRun

SRC = Path(__file__).resolve().parents[1] / "src" / "dynarl"


def sections() -> dict[str, type[msgspec.Struct]]:
    """Each section's name in the tree -> its class (every section of every tree)."""
    out: dict[str, type[msgspec.Struct]] = {}
    for root in (DynaRLConfig, SimulatedRun):
        for field in msgspec.structs.fields(root):
            cls = field.type
            is_section = isinstance(cls, type) and issubclass(cls, msgspec.Struct)
            if is_section and cls is not DynaRLConfig:
                out[field.name] = cls
    return out


SECTIONS = sections()
CLASSES = {cls.__name__: cls for cls in SECTIONS.values()}
FIELDS = {cls.__name__: {f.name for f in msgspec.structs.fields(cls)} for cls in SECTIONS.values()}


def _annotation_class(node: ast.expr | None) -> tuple[str, ...] | None:
    """The section classes an annotation names (``RolloutConfig``,
    ``"RolloutConfig"``, ``RolloutConfig | None``, ``RolloutConfig | ActorConfig``)."""
    if node is None:
        return None
    words = ast.unparse(node).strip("'\"").replace("|", " ").split()
    return tuple(name for name in CLASSES if name in words) or None


def _tail(node: ast.expr) -> str | None:
    """The last name of a dotted expression (``cfg.run.rollout`` -> ``rollout``)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


class _Reads(ast.NodeVisitor):
    """Collects ``(class, field)`` reads in one module."""

    def __init__(self) -> None:
        self.reads: set[tuple[str, str]] = set()
        self.bound: list[dict[str, tuple[str, ...]]] = [{}]  # expression -> section classes
        self.attrs: dict[str, tuple[str, ...]] = {}  # self.X -> section classes (per class)
        self.owner: str | None = None  # the section class being defined

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        saved_attrs, saved_owner = self.attrs, self.owner
        self.attrs = {}
        self.owner = node.name if node.name in CLASSES else None
        for stmt in node.body:  # annotated attributes of the class
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                cls = _annotation_class(stmt.annotation)
                if cls and node.name not in CLASSES:
                    self.attrs[f"self.{stmt.target.id}"] = cls
        self.generic_visit(node)
        self.attrs, self.owner = saved_attrs, saved_owner

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self.owner is not None and node.name == "__post_init__":
            return  # validation is not use
        scope = dict(self.attrs)
        for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
            cls = _annotation_class(arg.annotation)
            if cls:
                scope[arg.arg] = cls
        if self.owner is not None and node.args.args:
            scope[node.args.args[0].arg] = (self.owner,)
        self.bound.append(scope)
        self.generic_visit(node)
        self.bound.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815 (the visitor's own name)

    def _section_of(self, node: ast.expr) -> tuple[str, ...] | None:
        text = ast.unparse(node)
        for scope in reversed(self.bound):
            if text in scope:
                return scope[text]
        tail = _tail(node)
        if tail in SECTIONS and isinstance(node, ast.Attribute):
            return (SECTIONS[tail].__name__,)
        return None

    def _bind(self, target: ast.expr, value: ast.expr | None, annotation: ast.expr | None) -> None:
        cls = _annotation_class(annotation)
        if cls is None and value is not None:
            cls = self._section_of(value)
        if cls is None:
            return
        text = ast.unparse(target)
        self.bound[-1][text] = cls
        if text.startswith("self."):
            self.attrs[text] = cls

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts, strict=False):
                    self._bind(t, v, None)
            else:
                self._bind(target, node.value, None)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._bind(node.target, node.value, node.annotation)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._bind(node.target, node.value, None)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        for cls in self._section_of(node.value) or ():
            if node.attr in FIELDS[cls]:
                self.reads.add((cls, node.attr))
        self.generic_visit(node)


def reads() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in SRC.rglob("*.py"):
        if path.name == "config_doc.py":
            continue  # documenting a field is not reading it
        visitor = _Reads()
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        found |= visitor.reads
    return found


def unread() -> list[str]:
    found = reads()
    return sorted(
        f"{section}.{field}"
        for section, cls in SECTIONS.items()
        for field in FIELDS[cls.__name__]
        if (cls.__name__, field) not in found
    )


def test_every_config_field_is_read_by_something() -> None:
    assert unread() == []


def test_the_check_finds_a_field_nothing_reads(monkeypatch) -> None:
    """The check is not vacuous: a field added to a section and read nowhere is named."""

    class Probe(msgspec.Struct, frozen=True, kw_only=True):
        tp: int = 1
        never_read_anywhere: int = 0

    monkeypatch.setitem(SECTIONS, "rollout", Probe)
    monkeypatch.setitem(CLASSES, "Probe", Probe)
    monkeypatch.setitem(FIELDS, "Probe", {"tp", "never_read_anywhere"})
    missing = unread()
    assert "rollout.never_read_anywhere" in missing
    assert "rollout.tp" not in missing
