"""Sweep: the "moe_ops" experts implementation vs transformers' "eager" on every transformers model type
whose modeling file uses @use_experts_implementation (tiny random float32 models, CPU).

    python tools/transformers_sweep.py                 # all entries, each in a subprocess; writes $SWEEP_DIR/sweep.jsonl
    python tools/transformers_sweep.py --only mixtral gpt_oss
    python tools/transformers_sweep.py --one mixtral   # run one entry in-process, print its JSON record
    python tools/transformers_sweep.py --table         # print the table from $SWEEP_DIR/sweep.jsonl

SWEEP_DIR defaults to moe_ops_transformers_sweep in the system's temporary directory.

Per entry: build a tiny config from the config class defaults (shrink + per-model EXTRA overrides), build
the causal LM (or the text model / base model holding the experts), re-init every parameter with
randn*0.05 (seed 0), then run the same input_ids [2, 7] with experts implementation "eager",
"batched_mm" and "grouped_mm" (transformers' own, as controls) and "moe_ops" (fused_experts spied),
and classify: PASS / MISMATCH / REFUSED / ERROR / NOT_RUN / SKIPPED.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.environ.get("SWEEP_DIR") or os.path.join(tempfile.gettempdir(), "moe_ops_transformers_sweep")
OUT = os.path.join(HERE, "sweep.jsonl")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # subprocesses import moe_ops from here
DETAILS = os.path.join(HERE, "details")
TOL = 1e-4  # logits
# first experts module's output in the stressed pass (fp32; transformers' batched_mm vs eager is ~1e-7 there; a
# gelu <-> gelu_tanh swap gives ~1e-4 here but only ~1e-5 on the logits, see TF_SWEEP_SANITY)
EXPERTS_TOL = 1e-5
SEQ = (2, 7)

# --------------------------------------------------------------------------------------------- entries


def discover():
    """[(entry, model_dir, experts_class_name)] for every @use_experts_implementation class."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    entries = []
    for d in sorted(os.listdir(root)):
        if not os.path.isdir(os.path.join(root, d)):
            continue
        for f in sorted(os.listdir(os.path.join(root, d))):
            if not (f.startswith("modeling_") and f.endswith(".py")):
                continue
            src = open(os.path.join(root, d, f)).read()
            classes = re.findall(r"^@use_experts_implementation[^\n]*\nclass (\w+)\(", src, re.M)
            for c in classes:
                name = d if len(classes) == 1 else f"{d}:{'talker' if 'Talker' in c else 'thinker' if 'Thinker' in c else c}"
                entries.append((name, d, c, f[:-3]))
    return entries


# Which config to build, when not the model type itself / its "_text" sub-config.
CONFIG_KEY = {
    "qwen3_omni_moe:thinker": "qwen3_omni_moe_text",
    "qwen3_omni_moe:talker": "qwen3_omni_moe_talker_text",
}
# Model class to build when the automatic choice is not right (by class name, from the modeling module).
MODEL_CLASS = {
    "qwen3_omni_moe:thinker": "Qwen3OmniMoeThinkerTextModel",
    "qwen3_omni_moe:talker": "Qwen3OmniMoeTalkerModel",
}

# Per-model config overrides applied after the generic shrink (only what the generic one gets wrong).
EXTRA: dict[str, dict] = {
    "gemma4": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                   hidden_size_per_layer_input=16, vocab_size_per_layer_input=128),
    "diffusion_gemma": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32),
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "flint": dict(mlp_only_layers=[]),
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
                  use_mamba_kernels=False, mamba_dt_rank=8),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe"], mtp_layers_block_type=["full_attention", "moe"],
                       use_mamba_kernels=False, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=1,
                       chunk_size=8, moe_shared_expert_intermediate_size=32),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8,
                             layer_types=["mamba", "attention"]),
    "ernie4_5_moe": dict(moe_layer_start_index=0, moe_layer_end_index=1),
    "zaya": dict(router_hidden_size=16, num_experts_per_tok=1),
    "mistral4": dict(head_dim=16, num_key_value_heads=2),  # its head_dim is not the MLA rope dim
    "deepseek_ocr2": dict(num_experts_per_tok=2, mlp_layer_types=["sparse", "sparse"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "glm5_next": dict(num_key_value_heads=4),
    "qwen3_omni_moe:talker": dict(shared_expert_intermediate_size=32),
    "ernie4_5_vl_moe": dict(rope_parameters={"rope_theta": 500000.0, "rope_type": "default", "mrope_section": [3, 3, 2]}),
    "glm4v_moe": dict(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default",
                                       "mrope_section": [2, 1, 1]}),
    "hy_v4_vl": dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}),
    "dots3_note": dict(num_key_value_heads=4),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
}

# --------------------------------------------------------------------------------------------- config

COMMON = dict(num_hidden_layers=2, hidden_size=64, vocab_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k_experts")
SMALL = dict(
    # MLA (DeepSeek-like)
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
    o_lora_rank=16, o_groups=2,
    # DSA indexers
    index_n_heads=2, index_head_dim=16, indexer_n_heads=2, indexer_head_dim=16,
    # linear attention / hybrids
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_head_dim=16, linear_num_heads=4,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    rotary_dim=8, router_hidden_size=16, moe_hidden_size=32, ple_embed_dim=16, hc_lowrank=8, loop_gate_rank=8,
    gated_norm_rank=8, d_rel=4,
)
ZERO_KEYS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
ONE_KEYS = ("decoder_sparse_step", "moe_layer_freq", "moe_layer_interval")
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id")


def _pick_layers(layer_types):
    """Indices of the 2 layers to keep: the first, and the first of another type if any."""
    if isinstance(layer_types, list) and layer_types:
        for j, t in enumerate(layer_types):
            if t != layer_types[0]:
                return [0, j]
    return [0, 1]


def shrink(cfg_cls, entry):
    default = cfg_cls()
    d = {k: v for k, v in default.to_dict().items()}
    n_layers = d.get("num_hidden_layers")
    kw = {}
    for k, v in COMMON.items():
        if k in d:
            kw[k] = v
    for k, v in d.items():
        if k in ("id2label", "label2id") or k.startswith("_"):
            continue
        if k in EXPERT_KEYS and isinstance(v, int) and v > 0:
            kw[k] = 8
        elif k in TOPK_KEYS and isinstance(v, int):
            kw[k] = 2
        elif k in ("n_group", "num_expert_group") and isinstance(v, int) and v > 1:
            kw[k] = 2
        elif k == "topk_group" and isinstance(v, int) and v > 1:
            kw[k] = 1
        elif "intermediate" in k and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            kw[k] = 32
        elif "intermediate" in k and isinstance(v, list) and all(isinstance(x, int) for x in v):
            kw[k] = [32] * len(v)
        elif k in SMALL and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            kw[k] = SMALL[k]
        elif k in ZERO_KEYS and isinstance(v, int):
            kw[k] = 0
        elif k in ONE_KEYS and isinstance(v, int):
            kw[k] = 1
        elif k == "mlp_only_layers" and isinstance(v, list):
            kw[k] = []
        elif k in TOKEN_KEYS:
            if isinstance(v, int) and v >= 128:
                kw[k] = {"pad_token_id": 0, "bos_token_id": 1}.get(k, 2)
            elif isinstance(v, list):
                kw[k] = [x if x < 128 else 2 for x in v]
    if "unpadded_vocab_size" in d and d["unpadded_vocab_size"] is not None:
        kw["unpadded_vocab_size"] = 128
    # per-layer lists
    idx = _pick_layers(d.get("layer_types"))
    if isinstance(n_layers, int):
        for k, v in d.items():
            if not (isinstance(v, list) and len(v) == n_layers):
                continue
            if k == "mlp_layer_types":
                sparse = [x for x in v if x != "dense"]
                kw[k] = [sparse[0]] * 2 if sparse else v[:2]
            elif k == "kv_source_layers":
                kw[k] = [0, 1]
            else:
                kw[k] = [v[i] for i in idx]
    if "kv_lora_rank" in d and "qk_rope_head_dim" in d and "head_dim" in d:
        # DeepSeek-like MLA: head_dim is the rotary dim (qk_rope_head_dim)
        kw["head_dim"] = kw.get("qk_rope_head_dim", d["qk_rope_head_dim"])
        if "num_key_value_heads" in d:  # MLA keys/values have one head per query head
            kw["num_key_value_heads"] = kw.get("num_attention_heads", d.get("num_attention_heads"))
    kw.update(EXTRA.get(entry, {}))
    kw.update(json.loads(os.environ.get("TF_SWEEP_OVERRIDES", "{}")))  # --acts variants
    return cfg_cls(**kw)


# --------------------------------------------------------------------------------------------- model


def pick_model_class(entry, cfg, modeling):
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CLM, MODEL_MAPPING_NAMES as BASE

    if entry in MODEL_CLASS:
        return getattr(modeling, MODEL_CLASS[entry])
    key = cfg.model_type
    cands = []
    for mapping in (CLM, BASE):
        name = mapping.get(key)
        if name and hasattr(modeling, name):
            cands.append(getattr(modeling, name))
    mine = [c for c in vars(modeling).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
            and getattr(c, "config_class", None) is type(cfg)]
    cands += sorted([c for c in mine if c.__name__.endswith("ForCausalLM")], key=lambda c: c.__name__)
    cands += sorted([c for c in mine if c.__name__.endswith("Model") and "For" not in c.__name__], key=lambda c: c.__name__)
    if not cands:
        raise RuntimeError(f"no model class for config {type(cfg).__name__}")
    return cands[0]


def config_for(entry, model_dir):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CLM

    key = CONFIG_KEY.get(entry)
    if key is None:
        key = f"{model_dir}_text" if f"{model_dir}_text" in CONFIG_MAPPING else model_dir
    return shrink(CONFIG_MAPPING[key], entry)


def is_experts(m):
    return hasattr(m, "is_concatenated") and hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")


def reinit(model, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


INPUTS_EMBEDS = {"qwen3_omni_moe:talker"}  # models without an input embedding: feed a fixed random inputs_embeds


def forward(model, ids, entry=None):
    import torch

    if entry in INPUTS_EMBEDS:
        g = torch.Generator().manual_seed(2)
        emb = torch.randn(*ids.shape, model.config.hidden_size, generator=g)
        out = model(inputs_embeds=emb, use_cache=False)
    elif entry == "ernie4_5_vl_moe":
        # odd positions are "vision" tokens so that the vision experts run too
        tt = (torch.arange(ids.shape[1]) % 2).expand_as(ids).contiguous()
        out = model(input_ids=ids, moe_mm_token_type_ids=tt, use_cache=False)
    else:
        out = model(input_ids=ids, use_cache=False)
    for k in ("logits", "last_hidden_state"):
        v = getattr(out, k, None)
        if v is not None:
            return v
    return out[0]


def rel(a, b):
    import torch

    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


# --------------------------------------------------------------------------------------------- run one


def run_one(entry, model_dir, experts_cls, modeling_name):
    import torch

    warnings.filterwarnings("ignore")
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import moe_ops  # noqa: F401  registers "moe_ops"

    integ = importlib.import_module("moe_ops.integrations.transformers")
    if os.environ.get("TF_SWEEP_SANITY"):
        # negative control: a deliberately wrong activation mapping must be caught as MISMATCH
        real_act = integ.experts_activation
        swap = {"gelu_tanh": "gelu", "gelu": "gelu_tanh", "silu": "gelu"}

        def wrong_activation(experts):
            a = real_act(experts)
            return type(a)(swap.get(a.kind, a.kind), a.alpha, a.limit, interleaved=a.interleaved) if a.kind in swap else a

        integ.experts_activation = wrong_activation
    importlib.import_module("transformers.integrations.moe")
    modeling = importlib.import_module(f"transformers.models.{model_dir}.{modeling_name}")
    rec = {"entry": entry, "experts_class": experts_cls}
    torch.manual_seed(0)
    # ---- build
    try:
        cfg = config_for(entry, model_dir)
        rec["config"] = type(cfg).__name__
    except Exception as e:  # noqa: BLE001
        rec.update(outcome="SKIPPED", reason=f"config not built: {type(e).__name__}: {str(e)[:300]}", tb=traceback.format_exc()[-2000:])
        return rec
    try:
        cls = pick_model_class(entry, cfg, modeling)
        rec["model_class"] = cls.__name__
        model = cls._from_config(cfg, dtype=torch.float32)
        reinit(model)
    except Exception as e:  # noqa: BLE001
        rec.update(outcome="SKIPPED", reason=f"model not built: {type(e).__name__}: {str(e)[:300]}", tb=traceback.format_exc()[-2000:])
        return rec
    experts = [(n, m) for n, m in model.named_modules() if is_experts(m)]
    rec["experts_modules"] = len(experts)
    rec["experts_types"] = sorted({type(m).__name__ for _, m in experts})
    if not experts:
        rec.update(outcome="SKIPPED", reason="no @use_experts_implementation module in the built model")
        return rec
    m0 = experts[0][1]
    rec["flags"] = {k: getattr(m0, k) for k in ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")}
    rec["act_fn"] = type(getattr(m0, "act_fn", None)).__name__ if not callable(getattr(m0, "act_fn", None)) or isinstance(getattr(m0, "act_fn", None), torch.nn.Module) else getattr(m0.act_fn, "__qualname__", "?")
    rec["custom_apply_gate"] = type(m0)._apply_gate is not importlib.import_module("transformers.integrations.moe")._default_apply_gate
    ids = torch.randint(0, 128, SEQ, generator=torch.Generator().manual_seed(1))

    calls = {"experts": 0, "fused": 0}
    outs: dict[str, list] = {}
    cur = {"impl": None}

    def hook(mod, args, out):
        calls["experts"] += 1
        outs.setdefault(cur["impl"], []).append(out.detach().clone() if torch.is_tensor(out) else None)

    hooks = [m.register_forward_hook(hook) for _, m in experts]
    real_fused = integ.fused_experts

    def spy(*a, **k):
        calls["fused"] += 1
        return real_fused(*a, **k)

    integ.fused_experts = spy

    def run(impl):
        model.set_experts_implementation(impl)
        stale = sorted({m.config._experts_implementation for _, m in experts} - {impl})
        calls["experts"] = calls["fused"] = 0
        cur["impl"] = impl
        with torch.no_grad():
            y = forward(model, ids, entry)
        return y, dict(calls), stale

    try:
        try:
            eager, ce, stale = run("eager")
        except Exception as e:  # noqa: BLE001
            rec.update(outcome="SKIPPED", reason=f"eager forward failed: {type(e).__name__}: {str(e)[:300]}",
                       tb=traceback.format_exc()[-1500:])
            return rec
        rec["eager_experts_calls"] = ce["experts"]
        rec["eager_stale_impl"] = stale
        rec["logit_norm"] = float(eager.norm())
        for ctrl in ("batched_mm", "grouped_mm"):
            try:
                y, _, _ = run(ctrl)
                rec[f"{ctrl}_vs_eager"] = rel(y, eager)
            except Exception as e:  # noqa: BLE001
                rec[f"{ctrl}_vs_eager"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            ours, co, stale = run("moe_ops")
        except (NotImplementedError, ValueError, TypeError) as e:
            rec.update(outcome="REFUSED", reason=f"{type(e).__name__}: {str(e)[:400]}", fused_calls=calls["fused"],
                       tb=traceback.format_exc()[-1500:])
            return rec
        except Exception as e:  # noqa: BLE001
            rec.update(outcome="ERROR", reason=f"{type(e).__name__}: {str(e)[:400]}", fused_calls=calls["fused"],
                       tb=traceback.format_exc()[-2500:])
            return rec
        rec["moe_ops_stale_impl"] = stale
        rec["fused_calls"] = co["fused"]
        rec["moe_ops_experts_calls"] = co["experts"]
        err = rel(ours, eager)
        rec["rel_err"] = err
        if isinstance(rec.get("batched_mm_vs_eager"), float):
            y, _, _ = run("batched_mm")
            rec["moe_ops_vs_batched_mm"] = rel(ours, y)
        # first experts module's output (same input in eager and moe_ops up to the first MoE layer)
        if outs.get("eager") and outs.get("moe_ops") and outs["eager"][0] is not None and outs["moe_ops"][0] is not None:
            rec["first_experts_rel_err"] = rel(outs["moe_ops"][0], outs["eager"][0])
        if co["fused"] == co["experts"] > 0:
            # stress: the same model with experts pre-activations of std ~3 (and biases ~N(0,1)), so that the
            # activation's nonlinearity (gelu vs gelu_tanh, clamps) matters
            try:
                rec.update(stress_pass(model, experts, run, outs, cur))
            except Exception as e:  # noqa: BLE001
                rec["stress_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if co["fused"] == 0:
            rec.update(outcome="NOT_RUN", reason=f"fused_experts never called ({co['experts']} experts forwards; "
                       f"experts config impl {stale or 'moe_ops'})")
        elif co["fused"] < co["experts"]:
            rec.update(outcome="NOT_RUN", reason=f"fused_experts ran in {co['fused']} of {co['experts']} experts forwards")
        elif err < TOL and rec.get("stress_rel_err", 0) < TOL and rec.get("stress_first_experts_rel_err", 0) < EXPERTS_TOL:
            rec.update(outcome="PASS", reason=f"rel err {err:.1e}; stressed {rec.get('stress_rel_err', float('nan')):.1e}, "
                       f"experts out {rec.get('stress_first_experts_rel_err', float('nan')):.1e}")
        elif err < TOL:
            rec.update(outcome="MISMATCH", reason=f"rel err {err:.1e} but stressed {rec['stress_rel_err']:.2e}, experts out "
                       f"{rec.get('stress_first_experts_rel_err', float('nan')):.2e} (batched_mm vs eager stressed "
                       f"{rec.get('stress_batched_mm_vs_eager')})")
            dump_details(entry, m0)
        else:
            rec.update(outcome="MISMATCH", reason=f"rel err {err:.2e} (batched_mm vs eager {rec.get('batched_mm_vs_eager')})")
            dump_details(entry, m0)
        return rec
    finally:
        integ.fused_experts = real_fused
        for h in hooks:
            h.remove()


def up_weight(m):
    return m.gate_up_proj if m.has_gate else m.up_proj


def stress_pass(model, experts, run, outs, cur, target_std=3.0):
    """Rescale each experts module's gate/up weights so its pre-activations have std ~target_std (from the
    eager run's inputs), set biases ~N(0, 1), rerun eager / batched_mm / moe_ops."""
    import torch

    inputs = {}
    def grab(name):
        def pre_hook(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            inputs.setdefault(name, x.detach().clone())  # returns None: the call's arguments stay as they are
        return pre_hook

    hooks = [m.register_forward_pre_hook(grab(n), with_kwargs=True) for n, m in experts]
    try:
        run("eager")
    finally:
        for h in hooks:
            h.remove()
    stds = []
    with torch.no_grad():
        for n, m in experts:
            if n not in inputs:
                continue
            x = inputs[n].reshape(-1, inputs[n].shape[-1]).float()
            w = up_weight(m)
            h = torch.einsum("sh,ehn->sen", x, w) if m.is_transposed else torch.einsum("sh,enh->sen", x, w)
            factor = target_std / float(h.std())
            w.mul_(factor)
            stds.append(float(h.std()) * factor)
            if m.has_bias:
                for b in ("gate_up_proj_bias" if m.has_gate else "up_proj_bias", "down_proj_bias"):
                    getattr(m, b).normal_(0, 1)
    outs.clear()
    eager, _, _ = run("eager")
    rec = {"stress_preact_std": round(sum(stds) / max(len(stds), 1), 2)}
    try:
        y, _, _ = run("batched_mm")
        rec["stress_batched_mm_vs_eager"] = rel(y, eager)
    except Exception as e:  # noqa: BLE001
        rec["stress_batched_mm_vs_eager"] = f"{type(e).__name__}"
    ours, c, _ = run("moe_ops")
    rec["stress_fused_calls"] = c["fused"]
    rec["stress_rel_err"] = rel(ours, eager)
    if outs.get("eager") and outs.get("moe_ops"):
        rec["stress_first_experts_rel_err"] = rel(outs["moe_ops"][0], outs["eager"][0])
    return rec


def dump_details(entry, m):
    os.makedirs(DETAILS, exist_ok=True)
    cls = type(m)
    lines = [f"# {entry}: {cls.__module__}.{cls.__name__}", "## attributes"]
    for k, v in vars(m).items():
        if k.startswith("_") and k not in ("_is_expert_parallel",):
            continue
        lines.append(f"{k} = {v!r}"[:300])
    lines.append("## parameters: " + ", ".join(f"{n}{tuple(p.shape)}" for n, p in m.named_parameters(recurse=False)))
    lines.append("## buffers: " + ", ".join(f"{n}{tuple(p.shape)}" for n, p in m.named_buffers(recurse=False)))
    for fn_name in ("forward", "_apply_gate"):
        fn = getattr(cls, fn_name, None)
        fn = getattr(fn, "__wrapped__", fn)
        try:
            lines.append(f"## {fn_name} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})\n" + inspect.getsource(fn))
        except (TypeError, OSError) as e:
            lines.append(f"## {fn_name}: {e}")
    with open(os.path.join(DETAILS, entry.replace(":", "_") + ".txt"), "w") as f:
        f.write("\n".join(lines))


# --------------------------------------------------------------------------------------------- driver


def table(path=OUT):
    recs = [json.loads(line) for line in open(path)]
    print(f"{'model type':24s} {'experts class':34s} {'built':28s} {'outcome':9s} detail")
    for r in recs:
        print(f"{r['entry']:24s} {r['experts_class']:34s} {r.get('model_class', '-'):28s} {r['outcome']:9s} {r.get('reason', '')[:160]}")
    from collections import Counter

    print(Counter(r["outcome"] for r in recs))


ACTS = ["silu", "swish", "gelu", "gelu_python", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python_tanh",
        "gelu_accurate", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "tanh", "mish", "laplace",
        "linear", "sqrtsoftplus", "xielu", "hardswish", "leaky_relu", "prelu"]


def acts_sweep(timeout):
    """Each ACT2FN activation as hidden_act of a gated model (qwen3_moe) and as mlp_hidden_act of the one
    ungated model (nemotron_h): each must be PASS or REFUSED, never MISMATCH."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    recs = []
    for entry, key in (("qwen3_moe", "hidden_act"), ("nemotron_h", "mlp_hidden_act")):
        for act in ACTS:
            env["TF_SWEEP_OVERRIDES"] = json.dumps({key: act})
            p = subprocess.run([sys.executable, __file__, "--one", entry], capture_output=True, text=True, env=env,
                               cwd=REPO, timeout=timeout)
            m = re.search(r"^@@RESULT (.*)$", p.stdout, re.M)
            rec = json.loads(m.group(1)) if m else {"entry": entry, "outcome": "ERROR", "reason": (p.stdout + p.stderr)[-300:]}
            rec["variant"] = f"{key}={act}"
            recs.append(rec)
            print(f"{entry:12s} {key + '=' + act:32s} act_fn={rec.get('act_fn', '?'):24s} {rec['outcome']:9s} {rec.get('reason', '')[:130]}", flush=True)
    with open(os.path.join(HERE, "acts.jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--acts", action="store_true", help="activation variants of qwen3_moe (gated) and nemotron_h (not)")
    a = ap.parse_args()
    os.makedirs(HERE, exist_ok=True)
    if a.table:
        return table()
    entries = discover()
    if a.acts:
        return acts_sweep(a.timeout)
    if a.one:
        e = next(x for x in entries if x[0] == a.one)
        t0 = time.time()
        rec = run_one(*e)
        rec["seconds"] = round(time.time() - t0, 1)
        print("@@RESULT " + json.dumps(rec))
        return
    if a.only:
        entries = [e for e in entries if e[0] in a.only or e[1] in a.only]
    results = {}
    procs = []
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    pending = list(entries)
    while pending or procs:
        while pending and len(procs) < a.jobs:
            e = pending.pop(0)
            p = subprocess.Popen([sys.executable, __file__, "--one", e[0]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, cwd=REPO)
            procs.append((e, p, time.time()))
        time.sleep(0.2)
        for item in list(procs):
            e, p, t0 = item
            if p.poll() is None and time.time() - t0 < a.timeout:
                continue
            if p.poll() is None:
                p.kill()
            out = p.communicate()[0]
            procs.remove(item)
            m = re.search(r"^@@RESULT (.*)$", out, re.M)
            if m:
                rec = json.loads(m.group(1))
            else:
                rec = {"entry": e[0], "experts_class": e[2], "outcome": "ERROR" if p.returncode != -9 else "SKIPPED",
                       "reason": ("timeout" if p.returncode == -9 else f"subprocess died rc={p.returncode}: ") + out[-400:]}
            results[e[0]] = rec
            print(f"{rec['entry']:24s} {rec.get('model_class', '-'):30s} {rec['outcome']:9s} {rec.get('reason', '')[:150]}", flush=True)
    # merge with previous results (so --only updates entries in place)
    old = {}
    if a.only and os.path.exists(OUT):
        old = {r["entry"]: r for r in (json.loads(line) for line in open(OUT))}
    old.update(results)
    order = [e[0] for e in discover()]
    with open(OUT, "w") as f:
        for k in sorted(old, key=lambda k: order.index(k) if k in order else 999):
            f.write(json.dumps(old[k]) + "\n")


if __name__ == "__main__":
    main()
