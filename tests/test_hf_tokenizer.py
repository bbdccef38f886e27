"""Hugging Face tokenizers from a local folder: loading, chat template, padding, prompt datasets,
the model vocabulary they imply, package paths and the shipped tiny tokenizer.

Every tokenizer here is trained in the test with the ``tokenizers`` package (nothing is downloaded).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from resilient_rl.data.make_tokenizer import IM_END, PAD, jsonl_texts, train_tokenizer
from resilient_rl.errors import ConfigError
from resilient_rl.models.factory import build_causal_lm, model_vocab_size
from resilient_rl.models.hf import tiny_llama_config
from resilient_rl.config.schema import config_from_dict, load_config
from resilient_rl.config.schema import DataConfig, ModelConfig
from resilient_rl.data.loader import PromptDataset
from resilient_rl.config.paths import resolve_path
from resilient_rl.data.tasks import Sample, compute_rewards, get_task
from resilient_rl.data.tokenizer import CharTokenizer, HFTokenizer, build_tokenizer

TEXTS = ["Tom has 3 apples and buys 12 more. How many apples does he have?",
         "3+12=<<3+12=15>>15 apples.\n#### 15",
         "A box holds 1,234 pens. Each pen costs $2."] * 4


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """Three tokenizer folders: ChatML template + pad, no template, no pad token."""
    base = tmp_path_factory.mktemp("tok")
    return {"chat": str(train_tokenizer(TEXTS, base / "chat", vocab_size=300)),
            "plain": str(train_tokenizer(TEXTS, base / "plain", vocab_size=300, chat_template=None)),
            "nopad": str(train_tokenizer(TEXTS, base / "nopad", vocab_size=300, pad_token=None))}


def test_encode_decode_round_trip_and_ids(tok_dirs):
    tok = HFTokenizer.from_pretrained(tok_dirs["chat"])
    assert tok.vocab_size == len(tok.hf) == 300
    assert tok.hf.convert_ids_to_tokens([tok.eos_token_id, tok.pad_token_id]) == [IM_END, PAD]
    text = "Tom has 1,234 apples."
    assert tok.decode(tok.encode(text)) == text
    # A response is cut at the first eos; specials and ids past the vocabulary (spare model rows) vanish.
    ids = tok.encode("It is 15") + [tok.eos_token_id] + tok.encode(" junk")
    assert tok.decode_response(ids) == "It is 15"
    assert tok.decode_response(torch.tensor(tok.encode("It is") + [tok.vocab_size + 7, tok.pad_token_id])) == "It is"
    assert tok.batch_decode_responses(torch.tensor([ids, ids])) == ["It is 15", "It is 15"]


def test_chat_template_applied_by_default_and_switchable(tok_dirs):
    chat = HFTokenizer.from_pretrained(tok_dirs["chat"])
    assert chat.use_chat_template
    assert chat.format_prompt("How many?") == "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    ids = chat.encode_prompt("How many?")
    assert chat.hf.decode(ids) == chat.format_prompt("How many?")
    assert ids.count(chat.eos_token_id) == 1  # the user turn's end, written by the template, not twice

    off = HFTokenizer.from_pretrained(tok_dirs["chat"], chat_template=False)
    assert off.encode_prompt("How many?") == off.encode("How many?")
    plain = HFTokenizer.from_pretrained(tok_dirs["plain"])
    assert not plain.use_chat_template and plain.hf.decode(plain.encode_prompt("How many?")) == "How many?"
    with pytest.raises(ConfigError, match="data.chat_template=true but data.tokenizer=.* has no chat template"):
        HFTokenizer.from_pretrained(tok_dirs["plain"], chat_template=True)


def test_tokenizer_without_pad_pads_with_eos_and_says_so(tok_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="resilient_rl.data.tokenizer"):
        tok = HFTokenizer.from_pretrained(tok_dirs["nopad"])
    assert tok.hf.pad_token_id is None and tok.pad_token_id == tok.eos_token_id
    assert "has no pad token: padding with its eos token" in caplog.text


def test_prompt_dataset_left_pads_templated_prompts(tok_dirs):
    tok = HFTokenizer.from_pretrained(tok_dirs["nopad"])
    samples = [Sample("How many?", "#### 1"), Sample("Tom has 3 apples and buys 12 more. How many?", "#### 15")]
    ds = PromptDataset(samples, tok)
    short, long_ = tok.encode_prompt(samples[0].prompt), tok.encode_prompt(samples[1].prompt)
    assert ds.prompt_len == len(long_) > len(short)
    pad = ds.prompt_len - len(short)
    assert ds.input_ids[0, :pad].tolist() == [tok.pad_token_id] * pad and ds.input_ids[0, pad:].tolist() == short
    assert ds.attention_mask[0].tolist() == [0] * pad + [1] * len(short)
    assert ds.input_ids[1].tolist() == long_ and bool(ds.attention_mask[1].all())
    assert tok.hf.decode(ds.input_ids[0][ds.attention_mask[0].bool()]) == tok.format_prompt("How many?")
    ds.check_fits(ds.prompt_len + 8, 8)
    with pytest.raises(ConfigError, match="model.max_seq_len"):
        ds.check_fits(ds.prompt_len + 7, 8)


def test_build_tokenizer_from_config(tok_dirs, tmp_path):
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "What is 2+3?", "answer": "#### 5"}) + "\n")
    cfg = DataConfig(task="jsonl", path=str(data), reward_fn="gsm8k", tokenizer=tok_dirs["chat"])
    task = get_task(cfg)
    tok = build_tokenizer(cfg, task)
    assert isinstance(tok, HFTokenizer) and tok.use_chat_template
    # Rewards see the decoded response, cut at eos.
    rows = torch.tensor([tok.encode("so 5") + [tok.eos_token_id, 9], tok.encode("so 4") + [tok.pad_token_id] * 2])
    assert compute_rewards(task, tok, rows, ["#### 5", "#### 5"]).tolist() == [1.0, 0.0]
    char = build_tokenizer(DataConfig(task="add"), get_task(DataConfig(task="add")))
    assert isinstance(char, CharTokenizer) and char.alphabet == "0123456789+=>"


def test_bad_tokenizer_folders_are_config_errors(tmp_path, tok_dirs):
    with pytest.raises(ConfigError, match=r"data.tokenizer='.*missing'.* is not a directory.*never downloaded"):
        HFTokenizer.from_pretrained(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no loadable tokenizer"):
        HFTokenizer.from_pretrained(str(tmp_path / "empty"))
    noeos = train_tokenizer(TEXTS, tmp_path / "noeos", vocab_size=300)
    conf = json.loads((noeos / "tokenizer_config.json").read_text())
    del conf["eos_token"]
    (noeos / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="has no eos token"):
        HFTokenizer.from_pretrained(str(noeos))


def test_config_keys_are_validated():
    with pytest.raises(ConfigError, match=r"data\.chat_template.*needs data\.tokenizer"):
        load_config(None, ["data.chat_template=true"])
    with pytest.raises(ConfigError, match=r"data\.tokenizer"):
        load_config(None, ["data.tokenizer=''"])
    with pytest.raises(ConfigError, match=r"data\.reward_fn.*'gsm8k'"):
        load_config(None, ["data.task=jsonl", "data.path=x.jsonl", "data.reward_fn=gsm9k"])
    with pytest.raises(ConfigError, match=r"model\.max_seq_len.*max_position_embeddings=32"):
        config_from_dict({"model": {"kind": "hf", "hf_config": tiny_llama_config(16, max_position_embeddings=32),
                                    "max_seq_len": 64}})


def test_model_vocab_follows_the_tokenizer(tok_dirs, tmp_path):
    vocab = HFTokenizer.from_pretrained(tok_dirs["chat"]).vocab_size
    hf = tiny_llama_config(vocab_size=1, hidden_size=16, num_heads=2, intermediate_size=32)
    del hf["vocab_size"]
    auto = ModelConfig(kind="hf", hf_config=hf)
    assert model_vocab_size(auto, vocab) == vocab
    assert build_causal_lm(auto, vocab, seed=0).get_input_embeddings().num_embeddings == vocab
    bigger = ModelConfig(kind="hf", hf_config={**hf, "vocab_size": vocab + 12})
    assert model_vocab_size(bigger, vocab) == vocab + 12
    small = ModelConfig(kind="hf", hf_config={**hf, "vocab_size": vocab - 1})
    with pytest.raises(ConfigError, match=rf"model.hf_config.vocab_size={vocab - 1} is smaller than the "
                                          rf"tokenizer's vocabulary \({vocab} ids"):
        model_vocab_size(small, vocab)
    # A model folder's config.json is read without loading the weights.
    model = build_causal_lm(ModelConfig(kind="hf", hf_config={**hf, "vocab_size": vocab - 1}), None, seed=0)
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"model.path=.*config.json vocab_size\)=.* is smaller"):
        model_vocab_size(ModelConfig(kind="hf", path=str(tmp_path / "m")), vocab)
    assert model_vocab_size(ModelConfig(), 13) == 13  # tiny model: the tokenizer's


def test_pkg_paths():
    path = resolve_path("pkg://resilient_rl/data/gsm8k_sample.jsonl")
    assert path.endswith("resilient_rl/data/gsm8k_sample.jsonl") and open(path).readline().startswith('{"question"')
    assert resolve_path("relative/file.jsonl") == "relative/file.jsonl"
    assert resolve_path("s3://bucket/x.jsonl") == "s3://bucket/x.jsonl"
    with pytest.raises(ConfigError, match="package 'no_such_pkg_xyz' is not importable"):
        resolve_path("pkg://no_such_pkg_xyz/a.json", "data.path")
    with pytest.raises(ConfigError, match="data.tokenizer='pkg://resilient_rl'.*pkg://<package>/<path"):
        resolve_path("pkg://resilient_rl", "data.tokenizer")


def test_shipped_tokenizer_and_config():
    """The shipped folder loads through pkg://, is small, and fits every shipped prompt in the config."""
    cfg = load_config("pkg://resilient_rl/configs/gsm8k_llama.yaml")  # as `train --config pkg://...` reads it
    assert cfg == load_config(resolve_path("pkg://resilient_rl/configs/gsm8k_llama.yaml"))
    tok = build_tokenizer(cfg.data, get_task(cfg.data))
    assert tok.use_chat_template and tok.vocab_size == 512
    folder = resolve_path(cfg.data.tokenizer)
    import os

    assert sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) < 200 * 1024
    ds = PromptDataset.from_config(cfg.data, tok)
    ds.check_fits(cfg.model.max_seq_len, cfg.rollout.max_new_tokens)
    assert cfg.model.hf_config["max_position_embeddings"] >= cfg.model.max_seq_len
    q = jsonl_texts(resolve_path(cfg.data.path))[0]
    assert tok.hf.decode(tok.encode(q)) == q
