"""End to end from a model folder as a user has it: a tiny Qwen2-shaped and a tiny Llama-shaped
causal LM saved by ``save_pretrained`` with their tokenizer and a ``generation_config.json`` that
lists several eos ids, trained with GRPO through the trainer from ``model.path`` (nothing built
from a config dict, nothing downloaded)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from resilient_rl.config.paths import resolve_path
from resilient_rl.config.schema import load_config
from resilient_rl.data.make_tokenizer import IM_END, PAD, train_tokenizer
from resilient_rl.errors import ConfigError
from resilient_rl.trainer.local_roles import LocalRoles
from resilient_rl.trainer.ppo import PPOTrainer

PROBLEMS = [("Ann has 3 pens and buys 4 more. How many pens?", "3+4=<<3+4=7>>7\n#### 7"),
            ("A box has 6 eggs. How many eggs are in 2 boxes?", "6*2=<<6*2=12>>12\n#### 12"),
            ("Bo had 10 cards and lost 3. How many are left?", "10-3=<<10-3=7>>7\n#### 7"),
            ("A cup costs $5. How much do 3 cups cost?", "5*3=<<5*3=15>>15\n#### 15")]
EOT = "<|eot_id|>"

PROBE = '''
from resilient_rl.data.rewards import gsm8k

CALLS = []

def scored(response, answer):
    CALLS.append(response)
    return gsm8k(response, answer) + 0.01 * len(response)
'''

SHAPES = {
    # Qwen2.5's layout: grouped-query attention, q/k/v biases, tied embeddings.
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True, rms_norm_eps=1e-6),
    # Llama 3.2's: grouped-query attention, no biases, untied head.
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, rms_norm_eps=1e-5),
}


def save_model_folder(path, arch: str):
    """A folder as ``save_pretrained`` writes it: config.json, model.safetensors, tokenizer files
    and a generation_config.json whose eos_token_id lists several ids (as Qwen2.5's and Llama 3's do)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    eos = EOT if arch == "llama" else IM_END
    train_tokenizer([t for pair in PROBLEMS for t in pair], path, vocab_size=300, eos_token=eos)
    tok = json.loads((path / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos_ids = [ids[EOT], ids[IM_END], ids[PAD]] if arch == "llama" else [ids[IM_END], ids[PAD]]
    shape = dict(SHAPES[arch])
    config = AutoConfig.for_model(shape.pop("model_type"), vocab_size=300, eos_token_id=eos_ids[0], **shape)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids, "do_sample": True}))
    return model, eos_ids


@pytest.fixture
def setup(tmp_path, monkeypatch):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    module = f"hf_folder_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))

    def overrides(folder) -> list[str]:
        return [f"model.path={folder}", "model.hf_config=null", f"data.tokenizer={folder}",
                f"data.path={data}", f"data.reward_fn={module}:scored", "data.batch_size=4", "rollout.n=2",
                "rollout.max_new_tokens=8", "actor.mini_batch_size=4", "actor.micro_batch_tokens=64",
                "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.device=cpu",
                "telemetry.enabled=false", f"trainer.output_dir={tmp_path}/runs",
                f"checkpoint.root={tmp_path}/ckpt", "checkpoint.save_every=0"]

    yield overrides, module
    sys.modules.pop(module, None)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_trains_end_to_end_from_a_saved_model_folder(tmp_path, setup, arch):
    overrides, module = setup
    saved, eos_ids = save_model_folder(tmp_path / arch, arch)
    # Qwen2 trains on packed sequences, Llama on padded token-sized micro-batches.
    packing = ["actor.packing=true"] if arch == "qwen2" else []
    cfg = load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"), overrides(tmp_path / arch) + packing)
    assert cfg.model.hf_config is None and cfg.model.dtype == "auto"
    trainer = PPOTrainer(cfg, roles_factory=LocalRoles)
    # The tokenizer names one eos; the model's generation config adds the others, in its order.
    assert trainer.tokenizer.eos_token_ids[0] == trainer.tokenizer.eos_token_id == eos_ids[0]
    assert sorted(trainer.tokenizer.eos_token_ids) == sorted(eos_ids)
    response = trainer.tokenizer.encode("It is 7", add_special_tokens=False)
    assert trainer.tokenizer.decode_response(response + [eos_ids[-1]] + response) == "It is 7"
    try:
        rows = trainer.fit()
        roles = trainer.roles
        assert type(roles.actor.model).__name__ == type(saved).__name__
        assert roles.rollout.eos_token_id == trainer.tokenizer.eos_token_ids
        # The frozen reference holds the folder's weights: they were loaded, not re-initialised.
        ref = roles.ref.model.state_dict()
        for name, tensor in saved.state_dict().items():
            assert torch.equal(ref[name], tensor), name
        actor = roles.actor.model.state_dict()
        assert any(not torch.equal(actor[n], t) for n, t in saved.state_dict().items())  # it trained
    finally:
        trainer.shutdown()
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "reward/mean"):
            assert math.isfinite(r[key]), (key, r)
    assert len(sys.modules[module].CALLS) == 2 * 4 * 2


def test_max_seq_len_past_the_folders_context_fails_before_any_worker(tmp_path, setup):
    overrides, _ = setup
    save_model_folder(tmp_path / "qwen2", "qwen2")
    cfg = load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"),
                      overrides(tmp_path / "qwen2") + ["model.max_seq_len=256"])
    with pytest.raises(ConfigError, match=r"model.max_seq_len=256 is longer than the model's context: "
                                          r"model.path=.*qwen2.* max_position_embeddings=128"):
        PPOTrainer(cfg, roles_factory=LocalRoles)


def test_eos_ids_come_from_generation_config_then_config_json(tmp_path):
    from types import SimpleNamespace

    from resilient_rl.data.tokenizer import HFTokenizer
    from resilient_rl.models.hf_folder import model_eos_token_ids

    folder = tmp_path / "m"
    folder.mkdir()
    cfg = SimpleNamespace(kind="hf", path=str(folder), hf_config=None)
    assert model_eos_token_ids(cfg) == []
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert model_eos_token_ids(cfg) == [5]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    assert model_eos_token_ids(cfg) == [7, 5]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ConfigError, match=r"generation_config.json eos_token_id must be a token id"):
        model_eos_token_ids(cfg)
    assert model_eos_token_ids(SimpleNamespace(kind="hf", path=None, hf_config={"eos_token_id": [3, 4]})) == [3, 4]
    assert model_eos_token_ids(SimpleNamespace(kind="tiny", path=None, hf_config=None)) == []

    tok = HFTokenizer.from_pretrained(str(train_tokenizer(["a b c"], tmp_path / "tok", vocab_size=60)))
    tok.add_eos_token_ids([tok.eos_token_id, 0])
    assert tok.eos_token_ids == [tok.eos_token_id, 0]
    with pytest.raises(ConfigError, match=r"eos token id 999 .* outside data.tokenizer="):
        tok.add_eos_token_ids([999])


@pytest.mark.ray
def test_the_export_of_a_run_from_a_model_folder_loads_as_model_and_tokenizer(tmp_path, setup, ray_cluster):
    """Model in, model out: a run trained from a saved Hugging Face folder exports a folder that
    ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` load as they are, with the run's
    tokenizer and the trained weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resilient_rl.checkpoint.export import export_checkpoint

    overrides, _ = setup
    saved, _ = save_model_folder(tmp_path / "qwen2", "qwen2")
    run_overrides = [o for o in overrides(tmp_path / "qwen2") if not o.startswith("checkpoint.save_every")]
    cfg = load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"),
                      run_overrides + ["checkpoint.save_every=2", "trainer.run_name=model-out"])
    trainer = PPOTrainer(cfg)  # the worker groups on Ray: in-process roles save no checkpoints
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    out = tmp_path / "export"
    result = export_checkpoint("model-out", str(out), root=f"{tmp_path}/ckpt", output_dir=f"{tmp_path}/runs")
    assert "tokenizer.json" in result.files and "tokenizer_config.json" in result.files
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    source = AutoTokenizer.from_pretrained(tmp_path / "qwen2", local_files_only=True)
    assert tokenizer("It is 7")["input_ids"] == source("It is 7")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == type(saved).__name__
    exported = model.state_dict()
    assert exported.keys() == saved.state_dict().keys()
    assert any(not torch.equal(exported[n], t) for n, t in saved.state_dict().items())  # the trained weights
