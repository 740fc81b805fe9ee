"""Finding MoE op chains in a post-grad FX graph.

A chain ends at each moe_ops.weighted_reduce and is read backwards:
  [quantize] -> grouped_gemm (with gather_idx) -> activation -> [quantize] -> grouped_gemm (no gather)
  -> [post_expert_norm] -> weighted_reduce,
all three of the GEMMs and the reduction sharing one expert_offsets. It is fusable when every
intermediate (the quantized inputs and their scales, both GEMM outputs, the activation output) is
used by the chain alone; otherwise it is reported, with the reason, and left as it is.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

OPS = {
    "quantize": torch.ops.moe_ops.quantize.default,
    "grouped_gemm": torch.ops.moe_ops.grouped_gemm.default,
    "activation": torch.ops.moe_ops.activation.default,
    "weighted_reduce": torch.ops.moe_ops.weighted_reduce.default,
    "post_expert_norm": torch.ops.moe_ops.post_expert_norm.default,
}


def op_args(node: Node) -> dict:
    """The arguments of a call to a custom op, by schema name (defaults filled in)."""
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value
    return out


def label(node: Node) -> str:
    """A node as its op's name (aten.sum, moe_ops.activation), stable across torch versions, unlike node names."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}"
    return node.op if node.op in ("output", "placeholder") else getattr(t, "__name__", str(t))


def is_op(node, name: str) -> bool:
    """Whether `node` calls the moe_ops op OPS[name]."""
    return isinstance(node, Node) and node.op == "call_function" and node.target == OPS[name]


@dataclass
class Chain:
    """One MoE layer's nodes, in graph order."""

    reduce: Node
    gemm2: Node
    act: Node
    gemm1: Node
    quant1: Node | None = None
    quant2: Node | None = None
    norm: Node | None = None  # a post_expert_norm between gemm2 and reduce
    getitems: list[Node] = field(default_factory=list)
    position: int = 0  # the chain's place among the graph's weighted_reduce nodes (explain()'s layer order)

    def nodes(self) -> list[Node]:
        """Every node the fused pair replaces, users before producers (the order to erase them)."""
        order = [self.reduce, self.norm, self.gemm2, *[g for g in self.getitems if g.args[0] is self.quant2], self.quant2,
                 self.act, self.gemm1, *[g for g in self.getitems if g.args[0] is self.quant1], self.quant1]  # fmt: skip
        return [n for n in order if n is not None]


@dataclass
class Unfused:
    """A weighted_reduce the pass left alone, and why (explain()'s reason column)."""

    reduce: Node
    reason: str
    position: int = 0  # as Chain.position


def _input_of_gemm(gemm: Node, chain: Chain, slot: str):
    """The pre-quantization input of `gemm` and its quantize node (or None); raises ValueError."""
    a = op_args(gemm)
    act_in, scale = a["a"], a["a_scale"]
    if a["a_dtype"] == "none":
        return act_in, None
    ok = (
        isinstance(act_in, Node) and act_in.target is operator.getitem and act_in.args[1] == 0
        and isinstance(scale, Node) and scale.target is operator.getitem and scale.args[1] == 1
        and act_in.args[0] is scale.args[0] and is_op(act_in.args[0], "quantize")
    )  # fmt: skip
    if not ok:
        raise ValueError("a GEMM's quantized input does not come from one moe_ops.quantize")
    q = act_in.args[0]
    chain.getitems += [act_in, scale]
    setattr(chain, slot, q)
    return op_args(q)["x"], q


def _only_users(node: Node, allowed: set[Node], what: str) -> None:
    others = [label(u) for u in node.users if u not in allowed]
    if others:
        raise ValueError(f"{what} ({label(node)}) has another user: {', '.join(others)}")


def match(reduce: Node) -> Chain:
    """The chain ending at `reduce`; raises ValueError saying why there is none to fuse."""
    r = op_args(reduce)
    gemm2, norm = r["y"], None
    if is_op(gemm2, "post_expert_norm"):
        norm, gemm2 = gemm2, op_args(gemm2)["y"]
    if not is_op(gemm2, "grouped_gemm"):
        raise ValueError("the reduced rows do not come from a moe_ops.grouped_gemm" + (" through the norm" if norm else ""))
    g2 = op_args(gemm2)
    if g2["gather_idx"] is not None:
        raise ValueError("the second GEMM gathers tokens, so it is not a down projection")
    chain = Chain(reduce=reduce, gemm2=gemm2, act=None, gemm1=None, norm=norm)  # type: ignore[arg-type]
    act, _ = _input_of_gemm(gemm2, chain, "quant2")
    if not is_op(act, "activation"):
        raise ValueError("the second GEMM's input does not come from a moe_ops.activation")
    chain.act = act
    gemm1 = op_args(act)["x"]
    if not is_op(gemm1, "grouped_gemm"):
        raise ValueError("the activation's input does not come from a moe_ops.grouped_gemm")
    chain.gemm1 = gemm1
    g1 = op_args(gemm1)
    if g1["gather_idx"] is None:
        raise ValueError("the first GEMM does not gather tokens (no gather_idx)")
    if not (g1["expert_offsets"] is g2["expert_offsets"] is r["expert_offsets"]):
        raise ValueError("the GEMMs and the reduction use different expert_offsets")
    _input_of_gemm(gemm1, chain, "quant1")
    if chain.quant1 is not None:
        # gate_up quantizes x with the GEMM's own recipe (a_dtype, a_group, a_global_scale), the one it
        # dequantizes with; a quantize made with another one would be replaced by a different computation.
        q1 = op_args(chain.quant1)
        made = (q1["dtype"], list(q1["group"]))
        read = (g1["a_dtype"], list(g1["a_group"]))
        if made != read:
            raise ValueError(
                f"the first GEMM reads its input as {read[0]} {read[1]} but moe_ops.quantize made it as {made[0]} {made[1]}"
            )
        if q1["global_scale"] is not g1["a_global_scale"]:
            raise ValueError("the first GEMM's a_global_scale is not the global scale its input was quantized with")
    # Every intermediate must feed the chain only, or fusing would have to keep it alive too.
    _only_users(gemm2, {norm or reduce}, "the second GEMM's output")
    if norm is not None:
        _only_users(norm, {reduce}, "the post-expert norm's output")
    _only_users(gemm1, {act}, "the first GEMM's output")
    _only_users(act, {chain.quant2 or gemm2}, "the activation's output")
    for q, gemm in ((chain.quant1, gemm1), (chain.quant2, gemm2)):
        if q is not None:
            items = [g for g in chain.getitems if g.args[0] is q]
            _only_users(q, set(items), "a quantize")
            for g in items:
                _only_users(g, {gemm}, "a quantized activation")
    return chain


def find(graph: torch.fx.Graph) -> tuple[list[Chain], list[Unfused]]:
    """Every weighted_reduce's chain: the fusable ones and, for the others, why not."""
    chains, unfused = [], []
    reduces = [node for node in graph.nodes if is_op(node, "weighted_reduce")]
    for position, node in enumerate(reduces):
        try:
            chain = match(node)
        except ValueError as e:
            unfused.append(Unfused(node, str(e), position))
        else:
            chain.position = position
            chains.append(chain)
    return chains, unfused
