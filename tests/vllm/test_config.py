"""The plugin's registration and its per-module choice of method."""
from importlib.metadata import entry_points

import pytest
from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

from xmoe.vllm import register
from xmoe.vllm.config import Exl3Config
from xmoe.vllm.linear import Exl3LinearMethod

EXL3 = frozenset({"trellis", "suh", "svh", "mcg"})


def test_entry_point_and_idempotent_registration():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("exl3") == "xmoe.vllm:register"
    from vllm.model_executor.layers.quantization import get_quantization_config
    register()
    register()  # vLLM calls it in every process, possibly more than once
    assert get_quantization_config("exl3") is Exl3Config


def config(modules):
    c = Exl3Config.from_config({"quant_method": "exl3", "bits": 2, "codebook": "mcg", "version": "0.1.0",
                                "producer": {"name": "xmoe", "version": "0.1.0"}})
    c.modules, c.scanned = modules, True
    c.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    return c


def qkv():
    return object.__new__(QKVParallelLinear)  # only its type matters to the dispatch


def test_dispatch_by_checkpoint_contents():
    prefix = "model.layers.0.self_attn"
    all_exl3 = config({f"{prefix}.{p}": EXL3 for p in ("q_proj", "k_proj", "v_proj")})
    assert isinstance(all_exl3.get_quant_method(qkv(), f"{prefix}.qkv_proj"), Exl3LinearMethod)
    assert isinstance(config({}).get_quant_method(qkv(), f"{prefix}.qkv_proj"), UnquantizedLinearMethod)
    partial = config({f"{prefix}.q_proj": EXL3})
    with pytest.raises(ValueError, match="only some are EXL3"):
        partial.get_quant_method(qkv(), f"{prefix}.qkv_proj")
    assert config({}).get_quant_method(object(), "model.norm") is None


def test_checkpoint_names_follow_the_models_renames():
    """DeepSeek-V4 keeps DeepSeek's own names (`layers.N.ffn.experts.E.w1`); vLLM renames them on load
    (`model.layers.N.ffn...`), and the per-module choice must look them up under the new names."""
    from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM
    c = config({f"layers.1.ffn.experts.{e}.{w}": EXL3 for e in range(4) for w in ("w1", "w2", "w3")})
    c.apply_vllm_mapper(DeepseekV4ForCausalLM.hf_to_vllm_mapper.get_rename_mapper())
    assert set(c._scanned()) == {f"model.layers.1.ffn.experts.{e}.{w}" for e in range(4) for w in ("w1", "w2", "w3")}
    c.packed_modules_mapping = {"gate_up_proj": ["w1", "w3"]}
    assert c._suffixes("model.layers.1.ffn.shared_experts.gate_up_proj") == [None, None]  # left dense


def test_vllm_releases_outside_the_tested_range(monkeypatch, caplog):
    """Inside 0.26-0.32: silent. Outside: a warning when every vLLM name the plugin uses is there, else one
    line naming the range and what is missing."""
    from xmoe.vllm import compat
    compat.check_version("0.26.0")
    compat.check_version("0.32.0")
    assert compat.missing_names() == []  # this vLLM (0.32) has them all
    with caplog.at_level("WARNING"):
        compat.check_version("0.34.0")
    assert "tested with vLLM 0.26 to 0.32" in caplog.text
    monkeypatch.setattr(compat, "USED", compat.USED + (("vllm.model_executor.layers.linear", "NoSuchLayer"),))
    with pytest.raises(RuntimeError, match=r"supports vLLM 0.26 to 0.32; vLLM 0.40.0 lacks .*NoSuchLayer"):
        compat.check_version("0.40.0")
