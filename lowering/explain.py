"""explain(): compile with the pass and show what was fused, how it will run, and what was not and why."""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from . import backend
from moe_ops import _checks
from moe_ops.activation import PARAMETERS
from moe_ops.quant.scheme import GroupShape

from .chains import op_args
from .graph_pass import PassReport
from .install import enabled

_SYMBOL = re.compile(r"\b([su])\d+\b")
_SHORT_DTYPE = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
    torch.float8_e4m3fn: "f8e4m3",
}  # fmt: skip


class _Symbols:
    """Renames symbolic sizes (s0, s27, u3 ...) to S0, S1, ... in order of first appearance, since
    their numbering differs between runs and torch versions. Expressions are rebuilt with the new
    names before printing, so that products and sums print in an order that does not depend on the
    old numbering."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def _name(self, old: str) -> str:
        return self.names.setdefault(old, f"S{len(self.names)}")

    def __call__(self, text: str) -> str:
        return _SYMBOL.sub(lambda m: self._name(m.group(0)), text)

    def expr(self, value) -> str:
        if not isinstance(value, torch.SymInt):
            return str(value)
        import sympy

        e = value.node.expr
        old = sorted(e.free_symbols, key=lambda s: str(s))
        for s in old:  # symbols seen in earlier nodes keep their names; new ones follow in text order
            self._name(str(s))
        return str(e.xreplace({s: sympy.Symbol(self.names[str(s)], integer=True, positive=True) for s in old}))


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


def _meta(value, sym: _Symbols) -> str:
    if isinstance(value, torch.Tensor):
        dims = ", ".join(sym.expr(d) for d in value.shape)
        return f"{_SHORT_DTYPE.get(value.dtype, str(value.dtype))}[{dims}]"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_meta(v, sym) for v in value) + ")"
    return sym(str(value)) if value is not None else "-"


def normalize_graph(graph: Graph) -> str:
    """One line per node, nodes renamed in order (inputs in0.., values v0..), targets as ns.op,
    dtypes short, symbolic sizes renamed: stable across runs and torch versions."""
    sym, names, lines = _Symbols(), {}, []
    counts = {"placeholder": 0, "value": 0}

    def arg(a):
        if isinstance(a, Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        if isinstance(a, torch.dtype):
            return _SHORT_DTYPE.get(a, str(a))
        return sym(repr(a))

    for node in graph.nodes:
        if node.op == "placeholder":
            if not isinstance(node.meta.get("val"), torch.Tensor):
                # Symbolic-size inputs: their number and order vary with the torch version.
                names[node] = sym(str(node.meta.get("val")))
                continue
            names[node] = f"in{counts['placeholder']}"
            counts["placeholder"] += 1
            lines.append(f"{names[node]}: {_meta(node.meta.get('val'), sym)}")
        elif node.op == "output":
            lines.append(f"return {arg(node.args[0])}")
        else:
            names[node] = f"v{counts['value']}"
            counts["value"] += 1
            call = ", ".join([arg(a) for a in node.args] + [f"{k}={arg(v)}" for k, v in node.kwargs.items()])
            lines.append(f"{names[node]}: {_meta(node.meta.get('val'), sym)} = {_target_name(node.target)}({call})")
    return "\n".join(lines)


_CALL = re.compile(r"^(\w+(, \w+)* = )?torch\.ops\.moe_ops\.\w+\.\w+\(")
_CODE_RULES = (
    (re.compile(r"\bbuf\d+\b"), "buf#"),
    (re.compile(r"\barg\d+_\d+\b"), "arg#"),
    (re.compile(r"\b(cpp|triton)_(\w+?)_\d+\b"), r"\1_\2_#"),
)


def normalize_code_lines(sources: list[str]) -> list[str]:
    """The lines of Inductor's output code that call moe_ops ops, with buffer and argument numbers,
    kernel counters and symbolic sizes normalised."""
    out = []
    for src in sources:
        sym = _Symbols()
        for line in src.splitlines():
            line = line.strip()
            if not _CALL.match(line):
                continue
            for pattern, repl in _CODE_RULES:
                line = pattern.sub(repl, line)
            out.append(sym(line))
    return out


@dataclass
class LayerRow:
    """One MoE layer's row of explain()'s table."""

    layer: int
    fused: str
    recipe: str
    dtypes: str
    backend: str


def _fake_args(node: Node) -> dict:
    return {k: (v.meta.get("val") if isinstance(v, Node) else v) for k, v in op_args(node).items()}


def _backend_text(op: str, args: dict, device) -> str:
    recipe = getattr(backend, f"{op}_recipe")(args)
    try:
        choice = backend._choose(op, recipe, device)
    except RuntimeError as e:  # require_kernels: say so instead of failing to explain
        return f"{op}: none ({e})"
    return f"{op}: {choice.backend} ({choice.reason})"


def _quant_text(dtype: str, group) -> str:
    return "none" if dtype == "none" else f"{dtype} {GroupShape(*group)}"


def _weight_text(args: dict) -> str:
    return _quant_text(args["w_dtype"], args["w_group"]) + (" zero-point" if args["w_zero"] is not None else "")


def _recipe_text(gu: dict, dr: dict) -> str:
    """The layer's recipe from both fused ops' arguments: GEMM2's weights and bias are down_reduce's (a
    hand-written chain may quantize or bias its two GEMMs differently)."""
    params = PARAMETERS.get(gu["activation"], ())
    act = gu["activation"] + (f"({', '.join(f'{p}={gu[p]}' for p in params)})" if params else "")
    act += ", interleaved" if gu["interleaved"] else ""
    quant_a = _quant_text(gu["a_dtype"], gu["a_group"])
    quant_w = _weight_text(gu)
    if _weight_text(dr) != quant_w:
        quant_w = f"{quant_w} (w13), {_weight_text(dr)} (w2)"
    requant = _quant_text(gu["out_quant_dtype"], gu["out_quant_group"])
    bias = "+".join(name for name, args in (("w13", gu), ("w2", dr)) if args["bias"] is not None) or "no"
    norm = f"; post-norm=rms(eps={dr['norm_eps']})" if dr["norm_weight"] is not None else ""
    return f"act={act}; a-quant={quant_a}; w-quant={quant_w}; re-quant={requant}; bias={bias}{norm}"


def _rows(report: PassReport, start: int) -> list[LayerRow]:
    """One row per MoE layer of the graph, fused or not, in graph order (the order of the layers'
    weighted_reduce nodes), numbered from `start`."""
    rows = []
    for f in report.fused:
        gu, dr = _fake_args(f.gate_up), _fake_args(f.down_reduce)
        device = gu["x"].device
        dtypes = f"x {_SHORT_DTYPE.get(gu['x'].dtype)}, w {_SHORT_DTYPE.get(gu['w'].dtype)}, out {_SHORT_DTYPE.get(dr['out_dtype'])}"
        backends = f"{_backend_text('gate_up', gu, device)}; {_backend_text('down_reduce', dr, device)}"
        rows.append((f.chain.position, "gate_up + down_reduce", _recipe_text(gu, dr), dtypes, backends))
    for u in report.unfused:
        rows.append((u.position, "not fused", "-", "-", f"reason: {u.reason}"))
    rows.sort(key=lambda r: r[0])
    return [LayerRow(start + i, *r[1:]) for i, r in enumerate(rows)]


@dataclass
class Explanation:
    """What the lowering did to a compiled function: per compiled graph the normalised post-pass FX
    graph, one row per MoE layer, and the output-code lines that call moe_ops."""

    graphs: list[str] = field(default_factory=list)
    layers: list[LayerRow] = field(default_factory=list)
    code_lines: list[str] = field(default_factory=list)

    @property
    def graph(self) -> str:
        """Every compiled graph's normalised post-pass FX graph, blank-line separated."""
        return "\n\n".join(self.graphs)

    def table(self) -> str:
        """The markdown table: one row per MoE layer (fused ops, recipe, dtypes, backend or reason), or
        a line saying that no compiled graph held an MoE op chain."""
        if not self.layers:
            # A table of no rows reads like a failure to report; say what was looked for instead.
            return f"no MoE layer: none of the {len(self.graphs)} compiled graph(s) holds a moe_ops grouped_gemm chain"
        lines = ["| layer | fused ops | recipe | dtypes | backend / reason |", "|---|---|---|---|---|"]
        lines += [f"| {r.layer} | {r.fused} | {r.recipe} | {r.dtypes} | {r.backend} |" for r in self.layers]
        return "\n".join(lines)

    def code(self) -> str:
        """The output-code lines that call moe_ops ops."""
        return "\n".join(self.code_lines)

    def __str__(self) -> str:
        return f"{self.graph}\n\n{self.table()}"


@contextlib.contextmanager
def recording() -> Iterator[Explanation]:
    """Context manager: the pass is installed inside (as enabled() does), and the yielded Explanation
    gets, when the block ends, the post-pass graph and the MoE layer rows of every graph Inductor
    compiled inside it (its code_lines stay empty: explain() reads the output code). The FX graph
    cache is bypassed inside, so that every compile runs the pass: a cache hit would record nothing."""
    sink: list = []
    out = Explanation()
    with enabled() as moe_pass, torch._inductor.config.patch(fx_graph_cache=False):
        moe_pass.listeners.append(sink)
        try:
            yield out
        finally:
            moe_pass.listeners.remove(sink)
            for graph, report in sink:
                out.graphs.append(normalize_graph(graph))
                out.layers += _rows(report, len(out.layers))


def explain(fn_or_module, *example_inputs, dynamic: bool = True, **compile_kwargs) -> Explanation:
    """Compile fn_or_module(*example_inputs) with the MoE pass (fullgraph, dynamic by default), run it
    once under no_grad and return the Explanation, with the output code's lines that call moe_ops."""
    from torch._inductor.utils import run_and_get_code

    # torch.compile's own refusals of these are bare AssertionErrors.
    if not callable(fn_or_module):
        raise TypeError(f"fn_or_module: expected a function or an nn.Module, got {type(fn_or_module).__name__}")
    _checks.expect_bool("dynamic", dynamic, optional=True)
    compiled = torch.compile(fn_or_module, fullgraph=True, dynamic=dynamic, **compile_kwargs)
    with recording() as out, torch.no_grad():
        _, sources = run_and_get_code(compiled, *example_inputs)
    out.code_lines = normalize_code_lines(sources)
    return out
