"""An independent float64 re-computation of a MoE layer, and the tolerances every check uses.

This is a checker, not an op: it loops over experts on the host (syncs allowed) and shares no code with
the ops it checks beyond the weight decoding the caller chooses to pass in (pass float64 weights
that you dequantized yourself). Activation quantization can be re-applied in float64 so that schemes
quantizing activations are checked tightly too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ||out - ref|| / ||ref|| allowed for the dtype the layer runs in ...
DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# ... plus this much for activation quantization when the reference does not re-apply it
# (measured on random normal inputs: fp8 ~4e-2, int8 per-token ~1.6e-2, int8 with one static scale for
# the whole heavy-tailed intermediate 4.5e-2 to 8.6e-2, nvfp4 ~1.6e-1) ...
ACTIVATION_QUANT_TOLERANCE = {None: 0.0, "fp8": 8e-2, "int8": 3e-2, "int8_static": 1.2e-1, "nvfp4": 2.5e-1}
# ... or this much when it does (an element may round to the neighbouring code at a tie).
FAKE_QUANT_TOLERANCE = {None: 0.0, "fp8": 2e-3, "int8": 1e-3, "int8_static": 1e-3, "nvfp4": 1e-2}
# ... plus this much where the kernels multiply operands decoded to bf16/fp16 (dequant_kernels.py): their
# roundings (2**-9 relative in bf16) move GEMM1's output across code boundaries of GEMM2's quantized input
# more often than float32 products do. Measured on an H200 against moe_float64 with the weights rounded
# the same way: fp8 per-tensor 0.025 and nvfp4 0.034, against 0.022 and 0.030 without this term. nvfp4's
# 4-bit codes flip by larger steps: over 30 seeds its layer of 32 pairs (M = 16, E = 64) erred 0.031 at
# the median and 0.043 at most (bench/NOTES.md v51), hence 2e-2 there.
DECODED_OPERANDS_TOLERANCE = {None: 0.0, "fp8": 1e-2, "int8": 1e-2, "int8_static": 1e-2, "nvfp4": 2e-2}
# How far a layer's GEMM2 input may lie from the float64 one, relative to its row's max |value|, for
# float64_reference's tie_margin. Measured in float32 on 200 layers each of tests/lowering/test_pass.py's
# fp8 block, fp8 per tensor, int8 static and nvfp4 recipes (H = I = 128, M = 1 and 13): at most 1.35e-6
# (median 6e-7), so 1e-5 leaves room for larger K.
TIE_MARGIN = {torch.float32: 1e-5}


def tolerance(dtype: torch.dtype, activation_quant: str | None = None, fake_quant: bool = False, decoded: bool = False) -> float:
    """The allowed relative error of a layer in `dtype` whose activations are quantized to
    `activation_quant` (None: not quantized), against moe_float64; decoded: the layer multiplies
    operands decoded to `dtype` (DECODED_OPERANDS_TOLERANCE)."""
    table = FAKE_QUANT_TOLERANCE if fake_quant else ACTIVATION_QUANT_TOLERANCE
    extra = DECODED_OPERANDS_TOLERANCE[activation_quant] if decoded else 0.0
    return DTYPE_TOLERANCE[dtype] + table[activation_quant] + extra


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has a NaN; 0 for two empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    diff = (out.double().cpu() - ref.double().cpu()).norm().item()
    return diff / max(ref.double().norm().item(), 1e-300)


def _silu(x):
    return x / (1 + torch.exp(-x))


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def apply_activation(h: torch.Tensor, kind: str, alpha: float = 1.702, limit: float = 7.0, interleaved: bool = False):
    """float64 [n, 2I] (or [n, I] for relu2) -> [n, I]."""
    if kind == "relu2":
        return torch.clamp(h, min=0) ** 2
    gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=1)
    if kind in ("swigluoai", "silu_clamped"):
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, -limit, limit)
        if kind == "silu_clamped":
            return _silu(gate) * up
        return gate / (1 + torch.exp(-alpha * gate)) * (up + 1)
    if kind == "swiglu_softcapped":
        return alpha * torch.tanh(gate / alpha) / (1 + torch.exp(-gate)) * limit * torch.tanh(up / limit)
    return {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}[kind](gate) * up


def fake_quantize(x: torch.Tensor, dtype: str, group: tuple[int, int], scale=None, global_scale=None, offset=None) -> torch.Tensor:
    """float64 [M, K] -> the float64 values its quantization to `dtype` represents (independent of the ops).

    offset (float64 [M, K], optional) is added to x after the scales are chosen from x: it shows which
    code a nearby value gets under the same scales (tie_margin of float64_reference)."""
    m, k = x.shape
    gr, gc = group
    gr = m if gr == -1 else gr
    gc = k if gc == -1 else gc
    out = torch.empty_like(x)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    for r0 in range(0, m, max(gr, 1)):
        for c0 in range(0, k, gc):
            blk = x[r0 : r0 + gr, c0 : c0 + gc]
            amax = blk.abs().max().item() if blk.numel() else 0.0
            if offset is not None:
                blk = blk + offset[r0 : r0 + gr, c0 : c0 + gc]
            if dtype == "fp8":
                s = scale.item() if scale is not None else max(amax / 448.0, 1e-12)
                s32 = torch.tensor(s, dtype=torch.float32).item()
                q = (blk.float() / s32).clamp(-448, 448).to(torch.float8_e4m3fn).double()
                out[r0 : r0 + gr, c0 : c0 + gc] = q * s32
            elif dtype == "int8":
                s = scale.item() if scale is not None else max(amax / 127.0, 1e-12)
                s32 = torch.tensor(s, dtype=torch.float32).item()
                out[r0 : r0 + gr, c0 : c0 + gc] = torch.round(blk.float() / s32).clamp(-127, 127).double() * s32
            elif dtype == "nvfp4":
                g = global_scale.item()
                bs = torch.tensor(amax / 6.0 / g).clamp(max=448).to(torch.float8_e4m3fn).double().item() * g
                bs32 = torch.tensor(bs, dtype=torch.float32).item()
                y = blk.float() / (bs32 if bs32 > 0 else 1.0)
                nearest = (y.double().abs().unsqueeze(-1) - e2m1).abs()
                # ties go to the even code (round half to even, as NVIDIA's cvt.rn.satfinite.e2m1x2 does)
                idx = (nearest + 1e-12 * (torch.arange(8, dtype=torch.float64) % 2)).argmin(-1)
                out[r0 : r0 + gr, c0 : c0 + gc] = torch.sign(y.double()) * e2m1[idx] * bs32
            else:
                raise ValueError(f"fake_quantize: dtype {dtype!r} not one of fp8, int8, nvfp4")
    return out


@dataclass(frozen=True)
class Float64Reference:
    """float64_reference's result: the layer's float64 output and the activation codes of GEMM2's input
    that sat within tie_margin of a rounding boundary (either code is then correct for a layer that
    computes that input in lower precision).

    out: float64 [M, H]. ties: per output row that has any, (row, [n, H] float64): one row of the
    matrix per alternative code, the change it makes to out[row]."""

    out: torch.Tensor
    ties: tuple[tuple[int, torch.Tensor], ...] = ()

    def relative_error(self, got: torch.Tensor) -> float:
        """||got - r|| / ||out||, minimised over the references r that move any subset of the tied codes
        to their neighbours (as relative_error when there are none). Rows are independent, so each row's
        subsets are tried exhaustively (up to 2**10 of them; a greedy descent beyond that, which can only
        overstate the error)."""
        if not self.ties:
            return relative_error(got, self.out)
        diff = got.double().cpu() - self.out
        sq = diff.pow(2).sum(dim=1)
        for row, deltas in self.ties:
            sq[row] = _best_subset(diff[row], deltas)
        return sq.sum().sqrt().item() / max(self.out.norm().item(), 1e-300)


def _best_subset(r: torch.Tensor, deltas: torch.Tensor) -> float:
    """min over subsets S of ||r - sum_{i in S} deltas[i]||^2 (r: [H], deltas: [n, H])."""
    n = deltas.shape[0]
    if n <= 10:
        pick = (torch.arange(1 << n).unsqueeze(1) >> torch.arange(n)) & 1  # [2^n, n]
        return (r - pick.double() @ deltas).pow(2).sum(dim=1).min().item()
    best, left = r.pow(2).sum().item(), list(range(n))
    while left:
        errs = [(r - deltas[i]).pow(2).sum().item() for i in left]
        i = min(range(len(left)), key=errs.__getitem__)
        if errs[i] >= best:
            break
        best, r = errs[i], r - deltas[left.pop(i)]
    return best


def moe_float64(*args, **kwargs) -> torch.Tensor:
    """float64 [M, H]: float64_reference(*args, **kwargs).out (see there), without ties."""
    if kwargs.get("tie_margin"):
        raise TypeError("moe_float64 returns the output alone and would drop the ties; call float64_reference for tie_margin")
    return float64_reference(*args, **kwargs).out


def float64_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation="silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    act_quant=None,
    intermediate_dtype: torch.dtype | None = None,
    fused_activation: bool = False,
    post_expert_norm=None,
    tie_margin: float = 0.0,
) -> Float64Reference:
    """out: float64 [M, H] on the CPU: sum_j w[m, j] * (act(x_m @ w13[e].T + b13[e]) @ w2[e].T + b2[e]).

    w13/w2 are float weights in the logical layout ([E, 2I, H], [E, H, I]); act_quant, if given, is
    (dtype, group, a13_scale, a2_scale, a13_global_scale, a2_global_scale) and re-applies activation
    quantization to each GEMM's input; intermediate_dtype rounds the GEMM1 output and the activation
    output to that dtype, as a layer running in it stores them (and GEMM2's output and its norm's
    steps); fused_activation: GEMM1's output is not rounded, as a kernel that applies the activation to
    its float32 sums rounds only the activation's output (with a quantized GEMM2 input, the op chain's
    extra rounding shifts codes enough to double a bf16 layer's error: bench/NOTES.md v55). post_expert_norm (a moe_ops.PostExpertNorm: weight, eps), if given, replaces each expert's
    output y by s / sqrt(mean(s^2) + eps) with s = y * (1 + weight) before the router weight.

    tie_margin (with act_quant): GEMM2's input codes whose value lies within tie_margin * (its row's
    max |value|) of a rounding boundary are recorded as ties (Float64Reference.ties), each with the change
    its neighbouring code makes to the output. A layer computing that input in float32 lands within
    about 1.4e-6 of the row's max of the float64 value (TIE_MARGIN), so near a boundary either code is
    correct, and one such code flip can outweigh the rest of a small layer's rounding error.
    """
    if tie_margin and (act_quant is None or post_expert_norm is not None):
        raise ValueError(f"float64_reference: tie_margin={tie_margin} needs act_quant and no post_expert_norm "
                         f"(its ties are changes linear in GEMM2's input); got act_quant={act_quant is not None}, "
                         f"post_expert_norm={post_expert_norm is not None}")
    # Read the activation's fields here rather than through moe_ops' own resolve_activation: a bug there
    # (a parameter lost on the way) would otherwise reach the ops and this check alike.
    if isinstance(activation, str):
        kind, alpha, limit, interleaved = activation, 1.702, 7.0, False
    else:
        kind, alpha, limit, interleaved = activation.kind, activation.alpha, activation.limit, activation.interleaved
    x = hidden_states.detach().double().cpu()
    w13, w2 = w13.detach().double().cpu(), w2.detach().double().cpu()
    tw = topk_weights.detach().double().cpu()
    ids = topk_ids.detach().long().cpu()
    if apply_router_weight_on_input:
        x = (x * tw).to(hidden_states.dtype).double() if hidden_states.dtype != torch.float64 else x * tw
        tw = torch.ones_like(tw)
    local = ids if expert_map is None else expert_map.long().cpu()[ids]

    def rnd(t):
        return t.to(intermediate_dtype).double() if intermediate_dtype is not None else t

    if act_quant is not None:
        qdtype, group, s13, s2, g13, g2 = act_quant
        x = fake_quantize(x, qdtype, group, s13, g13)
    # Stage 1 for every expert, then activation quantization over all rows at once (a per-tensor
    # scale spans every expert's rows), then stage 2.
    groups = []
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].T
        if w13_bias is not None:
            h = h + w13_bias[e].double().cpu()
        groups.append((e, tok, slot, rnd(apply_activation(h if fused_activation else rnd(h), kind, alpha, limit, interleaved))))
    out = torch.zeros_like(x)
    if not groups:
        return Float64Reference(out)
    a_all = torch.cat([g[3] for g in groups])
    steps = []
    if act_quant is not None:
        a_pre, a_all = a_all, fake_quantize(a_all, qdtype, group, s2, g2)
        if tie_margin:
            steps = _neighbour_steps(a_pre, a_all, act_quant, tie_margin)
    ties = {}
    start = 0
    for e, tok, slot, a in groups:
        rows = slice(start, start + len(tok))
        y = a_all[rows] @ w2[e].T
        for step in steps:  # each tied code of this expert's rows: its change to the output row it feeds
            mine = step[rows]
            for i, c in (mine != 0).nonzero().tolist():
                ties.setdefault(int(tok[i]), []).append((mine[i, c] * tw[tok[i], slot[i]] * w2[e][:, c]).unsqueeze(0))
        start += len(tok)
        if w2_bias is not None:
            y = y + w2_bias[e].double().cpu()
        if post_expert_norm is not None:
            scale = (1 + post_expert_norm.weight.detach()).double().cpu()  # 1 + weight in the weight's dtype
            s = rnd(rnd(y) * scale)
            y = s / torch.sqrt((s * s).mean(dim=1, keepdim=True) + post_expert_norm.eps)
        out.index_add_(0, tok, rnd(y) * tw[tok, slot].unsqueeze(1))
    return Float64Reference(out, tuple((r, torch.cat(d)) for r, d in sorted(ties.items())))


def _neighbour_steps(a_pre, a_q, act_quant, margin):
    """GEMM2's whole input before (a_pre) and after (a_q) quantization -> [down, up]: each [rows, I] the
    change of code that a value margin * its row's max below / above would get (0 where none)."""
    qdtype, group, _, s2, _, g2 = act_quant
    m = margin * a_pre.abs().amax(dim=1, keepdim=True).expand_as(a_pre)
    return [fake_quantize(a_pre, qdtype, group, s2, g2, offset=sign * m) - a_q for sign in (-1.0, 1.0)]
