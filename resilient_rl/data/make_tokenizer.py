"""Train a small byte-level BPE tokenizer and save it as a Hugging Face tokenizer folder.

Nothing can be downloaded in the places this project is tested, so the example configs use a
tokenizer trained here, with the ``tokenizers`` package, on the shipped GSM8K-format sample.
The folder (``tokenizer.json`` + ``tokenizer_config.json``) loads with
``transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)`` and carries a
ChatML chat template whose end-of-turn token ``<|im_end|>`` is the eos token.

Rebuild the shipped folder with::

    python -m resilient_rl.data.make_tokenizer            # -> resilient_rl/data/tiny_tokenizer/

Byte-level BPE never needs an unknown token: any text encodes, merges only make it shorter.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterable, Optional

from resilient_rl.errors import ConfigError

HERE = Path(__file__).resolve().parent
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

#: ChatML: every turn is "<|im_start|>role\ncontent<|im_end|>\n"; the generation prompt opens the
#: assistant's turn, which the model ends with <|im_end|> (the eos token).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512,
                    chat_template: Optional[str] = CHATML_TEMPLATE, pad_token: Optional[str] = PAD,
                    eos_token: str = IM_END, model_max_length: int = 1024) -> Path:
    """Train a byte-level BPE on ``texts`` and write a ``transformers`` tokenizer folder to ``out_dir``.

    ``chat_template=None`` writes a tokenizer without a chat template and ``pad_token=None`` one
    without a pad token (both are cases the trainer handles). Returns the folder's path.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [t for t in texts if t]
    if not texts:
        raise ConfigError("train_tokenizer needs at least one non-empty text")
    specials = [t for t in (pad_token, IM_START, IM_END, eos_token) if t is not None]
    specials = list(dict.fromkeys(specials))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # Written by hand rather than by save_pretrained, so the folder does not depend on the
    # transformers version it was built with (chat_template inside tokenizer_config.json is
    # read by every version that knows chat templates).
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                                                  "rstrip": False, "normalized": False,
                                                                  "single_word": False} for t in specials}}
    if pad_token is not None:
        config["pad_token"] = pad_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def jsonl_texts(path: str | os.PathLike) -> list[str]:
    """Every string field of every record of a JSONL file (the training text of the tokenizer)."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts += [v for v in json.loads(line).values() if isinstance(v, str)]
    return texts


def main(argv: Optional[list[str]] = None) -> None:
    """Command line: train on JSONL files and write the folder (defaults rebuild the shipped one)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=[str(HERE / "gsm8k_sample.jsonl"),
                                                     str(HERE / "example_prompts.jsonl")],
                        help="JSONL files whose string fields are the training text")
    parser.add_argument("--out", default=str(HERE / "tiny_tokenizer"), help="output folder")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)
    texts = [t for path in args.data for t in jsonl_texts(path)]
    out = train_tokenizer(texts, args.out, vocab_size=args.vocab_size)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1024:.1f} KiB, {len(texts)} training texts)")


if __name__ == "__main__":
    main()
