"""expecttest snapshots of what the lowering does to each case: the normalised post-pass FX graph,
the per-layer table, and the lines of Inductor's output code that call moe_ops.

Regenerate with EXPECTTEST_ACCEPT=1 and READ the diff before committing it."""
from __future__ import annotations

import expecttest

import lowering

from .cases import CASES, inputs


class Snapshots(expecttest.TestCase):
    def explain(self, name: str) -> lowering.Explanation:
        model, h, e, dtype = CASES[name]()
        return lowering.explain(model, *inputs(h, e, dtype))

    def test_bf16_swiglu(self):
        e = self.explain("bf16_swiglu")
        self.assertExpectedInline(str(e), """\
in0: bf16[4, 128, 128]
in1: bf16[4, 128, 64]
in2: bf16[S0, 128]
in3: f32[S0, S1]
in4: i32[S0, S1]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in4, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: (bf16[S0*S1, 64], f32[0]) = moe_ops.gate_up(in2, None, None, 'none', [-1, -1], in0, None, None, None, 'none', [-1, -1], None, v1, v2, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, bf16, in4)
v5: bf16[S0*S1, 64] = getitem(v4, 0)
v6: bf16[S0, 128] = moe_ops.down_reduce(v5, None, None, 'none', [-1, -1], in1, None, None, None, 'none', [-1, -1], None, v1, in3, v3, bf16, True)
return [v6]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | gate_up + down_reduce | act=silu; a-quant=none; w-quant=none; re-quant=none; bias=no | x bf16, w bf16, out bf16 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.gate_up.default(arg#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, buf#, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, torch.bfloat16, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, arg#, buf#, torch.bfloat16, True)""")

    def test_fp8_block(self):
        e = self.explain("fp8_block")
        self.assertExpectedInline(str(e), """\
in0: f8e4m3[4, 256, 256]
in1: f8e4m3[4, 256, 128]
in2: f32[S0, 256]
in3: f32[S0, S1]
in4: i32[S0, S1]
in5: f32[4, 2, 2]
in6: f32[4, 2, 1]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in4, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: (f8e4m3[S0*S1, 128], f32[S0*S1, 1]) = moe_ops.gate_up(in2, None, None, 'fp8', [1, 128], in0, in5, None, None, 'fp8', [128, 128], None, v1, v2, 'silu', 1.702, 7.0, False, 'fp8', [1, 128], None, None, f32, in4)
v5: f8e4m3[S0*S1, 128] = getitem(v4, 0)
v6: f32[S0*S1, 1] = getitem(v4, 1)
v7: f32[S0, 256] = moe_ops.down_reduce(v5, v6, None, 'fp8', [1, 128], in1, in6, None, None, 'fp8', [128, 128], None, v1, in3, v3, f32, True)
return [v7]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | gate_up + down_reduce | act=silu; a-quant=fp8 1x128; w-quant=fp8 128x128; re-quant=fp8 1x128; bias=no | x f32, w f8e4m3, out f32 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.gate_up.default(arg#, None, None, 'fp8', [1, 128], arg#, arg#, None, None, 'fp8', [128, 128], None, buf#, buf#, 'silu', 1.702, 7.0, False, 'fp8', [1, 128], None, None, torch.float32, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, buf#, None, 'fp8', [1, 128], arg#, arg#, None, None, 'fp8', [128, 128], None, buf#, arg#, buf#, torch.float32, True)""")

    def test_fp8_per_tensor(self):
        e = self.explain("fp8_per_tensor")
        self.assertExpectedInline(str(e), """\
in0: f8e4m3[4, 256, 256]
in1: f8e4m3[4, 256, 128]
in2: f32[S0, 256]
in3: f32[S0, S1]
in4: i32[S0, S1]
in5: f32[4, 1, 1]
in6: f32[4, 1, 1]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in4, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: (f8e4m3[S0*S1, 128], f32[1, 1]) = moe_ops.gate_up(in2, None, None, 'fp8', [-1, -1], in0, in5, None, None, 'fp8', [-1, -1], None, v1, v2, 'silu', 1.702, 7.0, False, 'fp8', [-1, -1], None, None, f32, in4)
v5: f8e4m3[S0*S1, 128] = getitem(v4, 0)
v6: f32[1, 1] = getitem(v4, 1)
v7: f32[S0, 256] = moe_ops.down_reduce(v5, v6, None, 'fp8', [-1, -1], in1, in6, None, None, 'fp8', [-1, -1], None, v1, in3, v3, f32, True)
return [v7]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | gate_up + down_reduce | act=silu; a-quant=fp8 per-tensor; w-quant=fp8 per-tensor; re-quant=fp8 per-tensor; bias=no | x f32, w f8e4m3, out f32 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.gate_up.default(arg#, None, None, 'fp8', [-1, -1], arg#, arg#, None, None, 'fp8', [-1, -1], None, buf#, buf#, 'silu', 1.702, 7.0, False, 'fp8', [-1, -1], None, None, torch.float32, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, buf#, None, 'fp8', [-1, -1], arg#, arg#, None, None, 'fp8', [-1, -1], None, buf#, arg#, buf#, torch.float32, True)""")

    def test_int4_w4a16(self):
        e = self.explain("int4_w4a16")
        self.assertExpectedInline(str(e), """\
in0: u8[4, 256, 128]
in1: u8[4, 256, 64]
in2: f32[S0, 256]
in3: f32[S0, S1]
in4: i32[S0, S1]
in5: f32[4, 256, 4]
in6: f32[4, 256, 2]
in7: u8[4, 256, 4]
in8: u8[4, 256, 2]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in4, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: (f32[S0*S1, 128], f32[0]) = moe_ops.gate_up(in2, None, None, 'none', [-1, -1], in0, in5, None, in7, 'int4', [1, 64], None, v1, v2, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, f32, in4)
v5: f32[S0*S1, 128] = getitem(v4, 0)
v6: f32[S0, 256] = moe_ops.down_reduce(v5, None, None, 'none', [-1, -1], in1, in6, None, in8, 'int4', [1, 64], None, v1, in3, v3, f32, True)
return [v6]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | gate_up + down_reduce | act=silu; a-quant=none; w-quant=int4 1x64 zero-point; re-quant=none; bias=no | x f32, w u8, out f32 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.gate_up.default(arg#, None, None, 'none', [-1, -1], arg#, arg#, None, arg#, 'int4', [1, 64], None, buf#, buf#, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, torch.float32, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, None, None, 'none', [-1, -1], arg#, arg#, None, arg#, 'int4', [1, 64], None, buf#, arg#, buf#, torch.float32, True)""")

    def test_gpt_oss(self):
        e = self.explain("gpt_oss")
        self.assertExpectedInline(str(e), """\
in0: f32[4, 128, 128]
in1: f32[4, 128, 64]
in2: f32[4, 128]
in3: f32[4, 128]
in4: f32[S0, 128]
in5: f32[S0, S1]
in6: i32[S0, S1]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in6, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: (f32[S0*S1, 64], f32[0]) = moe_ops.gate_up(in4, None, None, 'none', [-1, -1], in0, None, None, None, 'none', [-1, -1], in2, v1, v2, 'swigluoai', 1.702, 7.0, True, 'none', [-1, -1], None, None, f32, in6)
v5: f32[S0*S1, 64] = getitem(v4, 0)
v6: f32[S0, 128] = moe_ops.down_reduce(v5, None, None, 'none', [-1, -1], in1, None, None, None, 'none', [-1, -1], in3, v1, in5, v3, f32, True)
return [v6]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | gate_up + down_reduce | act=swigluoai(alpha=1.702, limit=7.0), interleaved; a-quant=none; w-quant=none; re-quant=none; bias=w13+w2 | x f32, w f32, out f32 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.gate_up.default(arg#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], arg#, buf#, buf#, 'swigluoai', 1.702, 7.0, True, 'none', [-1, -1], None, None, torch.float32, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], arg#, buf#, arg#, buf#, torch.float32, True)""")

    def test_two_layers(self):
        e = self.explain("two_layers")
        self.assertExpectedInline(str(e), """\
in0: f32[4, 128, 128]
in1: f32[4, 128, 64]
in2: f32[S0, 128]
in3: f32[S0, S1]
in4: i32[S0, S1]
in5: f32[4, 128, 128]
in6: f32[4, 128, 64]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in4, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in4, 4, None)
v5: i32[5] = getitem(v4, 0)
v6: i32[S0*S1] = getitem(v4, 1)
v7: i32[S0*S1] = getitem(v4, 2)
v8: (f32[S0*S1, 64], f32[0]) = moe_ops.gate_up(in2, None, None, 'none', [-1, -1], in0, None, None, None, 'none', [-1, -1], None, v1, v2, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, f32, in4)
v9: f32[S0*S1, 64] = getitem(v8, 0)
v10: f32[S0, 128] = moe_ops.down_reduce(v9, None, None, 'none', [-1, -1], in1, None, None, None, 'none', [-1, -1], None, v1, in3, v3, f32, True)
v11: f32[S0, 128] = aten.add.Tensor(in2, v10)
v12: (f32[S0*S1, 64], f32[0]) = moe_ops.gate_up(v11, None, None, 'none', [-1, -1], in5, None, None, None, 'none', [-1, -1], None, v5, v6, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, f32, in4)
v13: f32[S0*S1, 64] = getitem(v12, 0)
v14: f32[S0, 128] = moe_ops.down_reduce(v13, None, None, 'none', [-1, -1], in6, None, None, None, 'none', [-1, -1], None, v5, in3, v7, f32, True)
v15: f32[S0, 128] = aten.add.Tensor(v11, v14)
return [v15]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | gate_up + down_reduce | act=silu; a-quant=none; w-quant=none; re-quant=none; bias=no | x f32, w f32, out f32 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |
| 1 | gate_up + down_reduce | act=silu; a-quant=none; w-quant=none; re-quant=none; bias=no | x f32, w f32, out f32 | gate_up: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)); down_reduce: reference (cpu: the CuTe DSL kernels run on CUDA GPUs (sm_90)) |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.gate_up.default(arg#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, buf#, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, torch.float32, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, arg#, buf#, torch.float32, True)
buf# = torch.ops.moe_ops.gate_up.default(buf#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, buf#, 'silu', 1.702, 7.0, False, 'none', [-1, -1], None, None, torch.float32, arg#)
buf# = torch.ops.moe_ops.down_reduce.default(buf#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, arg#, buf#, torch.float32, True)""")

    def test_second_user_not_fused(self):
        e = self.explain("second_user")
        self.assertExpectedInline(str(e), """\
in0: f32[S0, 128]
in1: f32[4, 128, 128]
in2: i32[S0, S1]
in3: f32[4, 128, 64]
in4: f32[S0, S1]
v0: (i32[5], i32[S0*S1], i32[S0*S1]) = moe_ops.routing_plan(in2, 4, None)
v1: i32[5] = getitem(v0, 0)
v2: i32[S0*S1] = getitem(v0, 1)
v3: i32[S0*S1] = getitem(v0, 2)
v4: f32[S0*S1, 128] = moe_ops.grouped_gemm(in0, None, None, 'none', [-1, -1], in1, None, None, None, 'none', [-1, -1], None, v1, v2, f32)
v5: f32[S0*S1, 64] = moe_ops.activation(v4, 'silu', 1.702, 7.0, False)
v6: f32[S0*S1, 128] = moe_ops.grouped_gemm(v5, None, None, 'none', [-1, -1], in3, None, None, None, 'none', [-1, -1], None, v1, None, f32)
v7: f32[S0, 128] = moe_ops.weighted_reduce(v6, in4, v3, v1)
v8: f32[S0*S1, 64] = aten.mul.Tensor(v5, 2.0)
return [v7, v8]

| layer | fused ops | recipe | dtypes | backend / reason |
|---|---|---|---|---|
| 0 | not fused | - | - | reason: the activation's output (moe_ops.activation) has another user: aten.mul |""")
        self.assertExpectedInline(e.code(), """\
buf# = torch.ops.moe_ops.routing_plan.default(arg#, 4, None)
buf# = torch.ops.moe_ops.grouped_gemm.default(arg#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, buf#, torch.float32)
buf# = torch.ops.moe_ops.activation.default(buf#, 'silu', 1.702, 7.0, False)
buf# = torch.ops.moe_ops.grouped_gemm.default(buf#, None, None, 'none', [-1, -1], arg#, None, None, None, 'none', [-1, -1], None, buf#, None, torch.float32)
buf# = torch.ops.moe_ops.weighted_reduce.default(buf#, arg#, buf#, buf#)""")
