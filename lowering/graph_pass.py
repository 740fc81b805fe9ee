"""The post-grad pass: each fusable MoE chain becomes moe_ops.gate_up + moe_ops.down_reduce."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

from . import chains as chains_mod
from .chains import Chain, Unfused, op_args
from .fused_ops import down_reduce, gate_up

GATE_UP = torch.ops.moe_ops.gate_up.default
DOWN_REDUCE = torch.ops.moe_ops.down_reduce.default
ROUTING_PLAN = torch.ops.moe_ops.routing_plan.default
# The pass's behaviour is these files: the pass, its patterns, the fused ops' registrations and the
# backend choice. Their hash is the pass's uuid, so the FX graph cache misses when any of them changes.
SOURCES = tuple(sorted(str(p) for p in Path(__file__).parent.glob("*.py")))


@dataclass
class Fused:
    """One replaced chain: the new nodes and the old chain (kept for explain())."""

    gate_up: Node
    down_reduce: Node
    chain: Chain


@dataclass
class PassReport:
    """What one run of the pass did to a graph: the chains it fused and those it declined."""

    fused: list[Fused]
    unfused: list[Unfused]


def _written_before(first: Node, values) -> bool:
    """Whether every value is a graph input, a constant or computed before `first` (an ancestor of it):
    then no kernel launched after `first` writes it, and down_reduce may read it before waiting for
    the kernel before it (fused_ops.py, weights_early). Weights computed in the graph (a dequantize,
    a cast) that gate_up does not depend on may be scheduled right before down_reduce."""
    ancestors, todo = set(), list(first.all_input_nodes)
    while todo:
        node = todo.pop()
        if node not in ancestors:
            ancestors.add(node)
            todo.extend(node.all_input_nodes)
    return all(not isinstance(v, Node) or v.op in ("placeholder", "get_attr") or v in ancestors for v in values)


def _plan_expert_ids(offsets) -> Node | None:
    """The topk_ids of the routing plan that made `offsets`, when no expert_map remaps them: the
    pairs' local experts, gate_up's hint (fused_ops.py, expert_ids). None otherwise."""
    plan = offsets.args[0] if isinstance(offsets, Node) and offsets.target is operator.getitem else None
    if not (isinstance(plan, Node) and plan.target is ROUTING_PLAN):
        return None
    args = op_args(plan)
    return args["topk_ids"] if args["expert_map"] is None else None


def _fake(node: Node):
    return node.meta.get("val") if isinstance(node, Node) else node


def _set_meta(node: Node, op, args: tuple) -> None:
    """Propagate fake values through the new node, as the rest of Inductor expects node.meta['val']."""
    fake_args = torch.fx.node.map_aggregate(args, _fake)
    mode = torch._guards.detect_fake_mode(fake_args)
    if mode is None:
        return
    with mode:
        node.meta["val"] = op(*fake_args)


def _replace(graph: Graph, chain: Chain) -> Fused:
    g1, g2 = op_args(chain.gemm1), op_args(chain.gemm2)
    act = op_args(chain.act)
    q1 = op_args(chain.quant1) if chain.quant1 is not None else None
    q2 = op_args(chain.quant2) if chain.quant2 is not None else None
    x = q1["x"] if q1 else g1["a"]
    with graph.inserting_before(chain.reduce):
        gu_args = (
            x, q1["scale"] if q1 else None, g1["a_global_scale"], g1["a_dtype"], g1["a_group"],
            g1["w"], g1["w_scale"], g1["w_global_scale"], g1["w_zero"], g1["w_dtype"], g1["w_group"],
            g1["bias"], g1["expert_offsets"], g1["gather_idx"],
            act["kind"], act["alpha"], act["limit"], act["interleaved"],
            q2["dtype"] if q2 else "none", q2["group"] if q2 else [-1, -1],
            q2["scale"] if q2 else None, q2["global_scale"] if q2 else None, g1["out_dtype"],
            _plan_expert_ids(g1["expert_offsets"]),
        )  # fmt: skip
        gu = graph.call_function(GATE_UP, gu_args)
        _set_meta(gu, gate_up, gu_args)
        inter = graph.call_function(operator.getitem, (gu, 0))
        scale = graph.call_function(operator.getitem, (gu, 1))
        if "val" in gu.meta:
            inter.meta["val"], scale.meta["val"] = gu.meta["val"]
        r = op_args(chain.reduce)
        dr_args = (
            inter, scale if q2 else None, g2["a_global_scale"], g2["a_dtype"], g2["a_group"],
            g2["w"], g2["w_scale"], g2["w_global_scale"], g2["w_zero"], g2["w_dtype"], g2["w_group"],
            g2["bias"], g2["expert_offsets"], r["topk_weights"], r["inverse"], g2["out_dtype"],
            _written_before(gu, (g2["w"], g2["expert_offsets"])),
        )  # fmt: skip
        if chain.norm is not None:
            n = op_args(chain.norm)
            dr_args += (n["weight"], n["eps"])
        dr = graph.call_function(DOWN_REDUCE, dr_args)
        _set_meta(dr, down_reduce, dr_args)
    for new in (gu, inter, scale, dr):
        new.meta.setdefault("stack_trace", chain.reduce.meta.get("stack_trace"))
    chain.reduce.replace_all_uses_with(dr)
    if not q2:
        graph.erase_node(scale)
    for node in chain.nodes():
        graph.erase_node(node)
    return Fused(gu, dr, chain)


def fuse(graph: Graph) -> PassReport:
    """Replace every fusable chain in `graph`; report what was fused and what was not, and why."""
    found, unfused = chains_mod.find(graph)
    fused = [_replace(graph, c) for c in found]
    if fused:
        graph.lint()
    return PassReport(fused, unfused)


class MoEFusionPass(CustomGraphPass):
    """A post_grad_custom_post_pass that fuses MoE chains, after running the pass it was installed
    over (if any). `reports` collects a PassReport per graph while explain() listens."""

    def __init__(self, previous=None):
        self.previous = previous
        self.listeners: list[list] = []

    def __call__(self, graph: Graph) -> None:
        prev = self.previous
        for p in prev if isinstance(prev, (list, tuple)) else ([prev] if prev is not None else []):
            p(graph)
        report = fuse(graph)
        for sink in self.listeners:
            sink.append((graph, report))

    def uuid(self):
        """The FX graph cache's key for the pass: our sources' hash, with any previous pass's uuid."""
        ours = get_hash_for_files(SOURCES).hex()
        prev = self.previous
        if prev is None:
            return ours
        prev_list = prev if isinstance(prev, (list, tuple)) else [prev]
        ids = []
        for p in prev_list:
            uid = p.uuid() if hasattr(p, "uuid") else None
            if uid is None:
                return None  # the previous pass cannot be hashed or opts out of caching: so do we
            ids.append(uid)
        return (ours, *ids)
