"""torch.library.opcheck on every moe_ops custom op, and the fake impls against the real outputs
(shape, dtype, strides), on realistic inputs built with moe_ops' own helpers (routing_plan for the
offsets/gather/inverse, quantize_weights for the weights). M = 0 and M = 1 are always included."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops  # noqa: F401  (registers the ops)
from moe_ops.activation import activation as activation_op
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant import ActivationQuant, GroupShape, QuantScheme, WeightQuant, quantize_weights
from moe_ops.quant.quantize import quantize
from moe_ops.reduce import weighted_reduce
from moe_ops.routing import route_op

TOKENS = (0, 1, 5)


def _outputs(x):
    return x if isinstance(x, (tuple, list)) else (x,)


def assert_fake_matches(op, args):
    """Run `op` for real and under FakeTensorMode; every output must agree in shape, dtype, strides."""
    real = _outputs(op(*args))
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _outputs(op(*fake_args))
    assert len(real) == len(fake)
    for i, (r, f) in enumerate(zip(real, fake)):
        assert tuple(f.shape) == tuple(r.shape), f"output {i}: fake shape {tuple(f.shape)}, real {tuple(r.shape)}"
        assert f.dtype == r.dtype, f"output {i}: fake dtype {f.dtype}, real {r.dtype}"
        assert f.stride() == r.stride(), f"output {i}: fake strides {f.stride()}, real {r.stride()}"
        assert f.device == r.device


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def assert_no_mutation_or_alias(op, args):
    """What opcheck's test_schema checks, done bitwise: the op leaves its inputs untouched and returns
    no alias of them."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    outs = _outputs(op(*args))
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)) if t.dtype in _FP8 else torch.equal(t, b)
    ptrs = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    assert not any(o.numel() and o.untyped_storage().data_ptr() in ptrs for o in outs)


def check(op, args):
    if any(isinstance(a, torch.Tensor) and a.dtype in _FP8 for a in args):
        # opcheck's test_schema compares inputs with torch.allclose, which has no float8 kernel on the
        # CPU (a torch limitation, not an op bug): run the other utils and check the schema bitwise.
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, tuple(args), test_utils=utils)
        assert_no_mutation_or_alias(op, args)
    else:
        torch.library.opcheck(op, tuple(args))
    assert_fake_matches(op, args)


def random_ids(m: int, k: int, num_experts: int, dtype=torch.int32) -> torch.Tensor:
    """k distinct experts per token."""
    return torch.rand(m, num_experts).argsort(dim=1)[:, :k].to(dtype).contiguous()


# ---- route ---------------------------------------------------------------------------------------

ROUTES = {
    "softmax": dict(scoring="softmax", renormalize=False),
    "softmax_renorm": dict(scoring="softmax", renormalize=True),
    "sigmoid_top1": dict(scoring="sigmoid", renormalize=False, top_k=1),
    "sigmoid_renorm": dict(scoring="sigmoid", renormalize=True),
    "grouped_bias": dict(scoring="sigmoid", renormalize=True, groups=(4, 2), bias=True, scale=2.5),
    "grouped": dict(scoring="softmax", renormalize=True, groups=(2, 1)),
}


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("method", list(ROUTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route(method, m, dtype):
    spec = ROUTES[method]
    num_experts, top_k = 8, spec.get("top_k", 3)
    groups, topk_group = spec.get("groups", (0, 0))
    bias = torch.randn(num_experts) * 0.1 if spec.get("bias") else None
    args = [torch.randn(m, num_experts).to(dtype), top_k, spec["scoring"], spec["renormalize"], groups, topk_group,
            bias, spec.get("scale", 1.0)]  # fmt: skip
    check(route_op, args)


# ---- routing_plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_map", [False, True])
def test_routing_plan(m, id_dtype, with_map):
    if with_map:
        expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=id_dtype)
        ids = random_ids(m, 2, 6, id_dtype)
        check(routing_plan, [ids, 4, expert_map])
    else:
        check(routing_plan, [random_ids(m, 2, 4, id_dtype), 4, None])


# ---- quantize ------------------------------------------------------------------------------------

QUANTIZE = {
    "fp8_per_tensor_static": ("fp8", [-1, -1], True, 64),
    "fp8_per_tensor_dynamic": ("fp8", [-1, -1], False, 64),
    "fp8_per_token": ("fp8", [1, -1], False, 64),
    "fp8_1x128": ("fp8", [1, 128], False, 320),  # 2.5 groups: a partial last group
    "int8_per_token": ("int8", [1, -1], False, 64),
    "int8_per_tensor_static": ("int8", [-1, -1], True, 64),
    "nvfp4": ("nvfp4", [1, 16], False, 64),
}


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("case", list(QUANTIZE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize(case, m, dtype):
    fmt, group, static, k = QUANTIZE[case]
    x = torch.randn(m, k).to(dtype)
    scale = torch.rand(1) * 0.02 + 0.005 if static else None
    global_scale = torch.tensor([3.0 / (448 * 6)]) if fmt == "nvfp4" else None
    check(quantize, [x, fmt, group, scale, global_scale])


# ---- grouped_gemm --------------------------------------------------------------------------------

# name -> (activation quant or None, weight quant or None)
GEMM_FORMATS = {
    "unquantized": (None, None),
    "fp8_block": (ActivationQuant("fp8", GroupShape(1, 32)), WeightQuant("fp8", GroupShape(32, 32))),
    "fp8_per_token": (ActivationQuant("fp8", GroupShape(1, -1)), WeightQuant("fp8", GroupShape(1, -1))),
    "int8_w8a8": (ActivationQuant("int8", GroupShape(1, -1)), WeightQuant("int8", GroupShape(1, -1))),
    "int4_zero_point": (None, WeightQuant("int4", GroupShape(1, 32), zero_point=True)),
    "int4_symmetric": (None, WeightQuant("int4", GroupShape(1, 32))),
    "nvfp4_w4a16": (None, WeightQuant("nvfp4", GroupShape(1, 16))),
    "nvfp4_w4a4": (ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("nvfp4", GroupShape(1, 16))),
    "mxfp4_w4a16": (None, WeightQuant("mxfp4", GroupShape(1, 32))),
    "mxfp4_w4a8": (ActivationQuant("fp8", GroupShape(-1, -1)), WeightQuant("mxfp4", GroupShape(1, 32))),
}
E, K_DIM, N_DIM, TOP_K = 4, 64, 96, 2


def _gemm_args(fmt: str, m: int, gather: bool, bias: bool, dtype: torch.dtype):
    aq, wq = GEMM_FORMATS[fmt]
    w = torch.randn(E, N_DIM, K_DIM) / K_DIM**0.5
    if wq is None:
        wt, w_scale, w_global, w_zero, w_dtype, w_group = w.to(dtype), None, None, None, "none", [-1, -1]
    else:
        scheme = QuantScheme(aq, wq)
        cal = torch.randn(8, K_DIM)
        wt, _, cfg = quantize_weights(scheme, w, torch.randn(E, K_DIM, N_DIM), calibration=cal, intermediate_calibration=torch.randn(8, N_DIM))
        w_scale, w_global, w_zero = cfg.w13_scale, cfg.w13_global_scale, cfg.w13_zero
        w_dtype, w_group = wq.dtype, list(wq.group.astuple())
    ids = random_ids(m, TOP_K, E)
    offsets, gather_idx, _ = routing_plan(ids, E, None)
    rows = m if gather else m * TOP_K
    a = torch.randn(rows, K_DIM).to(dtype)
    if aq is None:
        a_scale, a_global, a_dtype, a_group = None, None, "none", [-1, -1]
    else:
        a_dtype, a_group = aq.dtype, list(aq.group.astuple())
        a_global = torch.tensor([4.0 / (448 * 6)]) if aq.dtype == "nvfp4" else None
        a, a_scale = quantize(a, a_dtype, a_group, None, a_global)
    b = torch.randn(E, N_DIM).to(dtype) if bias else None
    return [a, a_scale, a_global, a_dtype, a_group, wt, w_scale, w_global, w_zero, w_dtype, w_group, b, offsets,
            gather_idx if gather else None, dtype]  # fmt: skip


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("fmt", list(GEMM_FORMATS))
@pytest.mark.parametrize("gather,bias", [(True, False), (False, True)])
def test_grouped_gemm(fmt, m, gather, bias):
    check(grouped_gemm, _gemm_args(fmt, m, gather, bias, torch.float32))


@pytest.mark.parametrize("m", (0, 3))
@pytest.mark.parametrize("fmt", ["unquantized", "int4_zero_point", "mxfp4_w4a16"])
def test_grouped_gemm_bf16(fmt, m):
    check(grouped_gemm, _gemm_args(fmt, m, True, True, torch.bfloat16))


@pytest.mark.parametrize("m", (1, 4))
def test_grouped_gemm_column_major_weight(m):
    args = _gemm_args("unquantized", m, True, False, torch.float32)
    args[5] = args[5].transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major per expert
    assert args[5].stride(1) == 1
    check(grouped_gemm, args)


# ---- activation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize(
    "kind,interleaved", [("silu", False), ("gelu", False), ("gelu_tanh", False), ("swigluoai", False),
                         ("swigluoai", True), ("silu_clamped", False), ("silu_clamped", True), ("silu", True),
                         ("swiglu_softcapped", False), ("swiglu_softcapped", True), ("relu2", False)]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation(kind, interleaved, m, dtype):
    width = 32 if kind == "relu2" else 64
    check(activation_op, [torch.randn(m * TOP_K, width).to(dtype) * 3, kind, 1.702, 7.0, interleaved])


# ---- weighted_reduce -----------------------------------------------------------------------------


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("dropped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_reduce(m, k, dropped, dtype):
    expert_map = torch.tensor([0, -1, 1, 2, 3]) if dropped else None
    ids = random_ids(m, k, 5 if dropped else 4)
    offsets, _, inverse = routing_plan(ids, 4, expert_map)
    y = torch.randn(m * k, 48).to(dtype)
    weights = torch.rand(m, k)
    check(weighted_reduce, [y, weights, inverse, offsets])


# Arguments the real and fake quantize disagreed on (a static scale with a per-token group: real [1, 1],
# fake [M, 1]) or crashed on (nvfp4 without its global scale): both impls now reject them alike.
# A static or global scale of several values (the fake impl took it; the real one failed in a reshape
# with a bare RuntimeError) is rejected alike too.
# name -> (dtype, group, values in the static scale, values in the global scale (0 / False: none),
# the error both impls raise)
BAD_QUANTIZE = {
    "static_scale_per_token": ("fp8", [1, -1], True, False, r"ActivationQuant.static: only per-tensor scales can be static, got group per-row"),
    "static_scale_1x128": ("fp8", [1, 128], True, False, r"ActivationQuant.static: only per-tensor scales can be static, got group 1x128"),
    "static_scale_nvfp4": ("nvfp4", [1, 16], True, True, r"ActivationQuant.static: only per-tensor scales can be static, got group 1x16"),
    "nvfp4_without_global_scale": ("nvfp4", [1, 16], False, False, r"global_scale: nvfp4 needs its float32 global scale \[1\], got None"),
    "global_scale_for_fp8": ("fp8", [-1, -1], False, True, r"global_scale: only nvfp4 uses a global scale, got one for fp8"),
    "int8_1x32": ("int8", [1, 32], False, False, r"ActivationQuant.group: 1x32 is not a int8 group shape"),
    "unknown_dtype": ("int4", [1, -1], False, False, r"dtype: got 'int4'; allowed: 'fp8', 'int8', 'nvfp4'"),
    "nvfp4_odd_k": ("nvfp4", [1, 16], False, True, r"x: nvfp4 packs two values per byte; K must be even, got K=127"),
    "static_scale_two_values": ("fp8", [-1, -1], 2, False, r"scale: a static scale is one per-tensor value, got shape \(2,\)"),
    "nvfp4_global_scale_two_values": ("nvfp4", [1, 16], False, 2, r"global_scale: expected one value \[1\], got shape \(2,\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_QUANTIZE))
def test_quantize_rejects_bad_args_real_and_fake(case):
    fmt, group, static, with_global, match = BAD_QUANTIZE[case]
    m = int(torch.randint(2, 9, ()))
    x = torch.randn(m, 127 if case == "nvfp4_odd_k" else 128)
    scale = torch.rand(int(static)) * 0.02 + 0.005 if static else None
    global_scale = torch.rand(int(with_global)) * 0.01 + 1e-3 if with_global else None
    with pytest.raises(ValueError, match=match):
        quantize(x, fmt, group, scale, global_scale)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        quantize(mode.from_tensor(x), fmt, group, scale if scale is None else mode.from_tensor(scale),
                 global_scale if global_scale is None else mode.from_tensor(global_scale))  # fmt: skip
