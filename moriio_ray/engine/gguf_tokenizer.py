"""A ``tokenizers`` tokenizer from a GGUF file's vocabulary, merges and token types.

llama.cpp stores a byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``: GPT-2, Llama 3,
Qwen2/3, SmolLM) as token strings, ``"a b"`` merge strings and one type per token. This rebuilds
the tokenizer that transformers builds from the same metadata (``gguf_file=`` in
``from_pretrained``), so both give the same ids:
- BPE over the vocabulary (a token spelled outside the byte alphabet is respelled into it);
- the split regex of the file's ``tokenizer.ggml.pre`` where it is a known one, else GPT-2's;
- control tokens (type 3) as special added tokens, user-defined ones (type 4) as plain added tokens;
- a BOS (EOS) in front of (after) every text only where ``tokenizer.ggml.add_bos_token``
  (``add_eos_token``) says so.
"""

from __future__ import annotations

import dataclasses
import functools

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from moriio_ray.engine.gguf_file import GGUFFile
from moriio_ray.errors import ConfigError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
MODELS = ("gpt2",)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (others: GPT-2's ByteLevel split)
SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """What the engine needs besides the tokenizer: special tokens, EOS ids, the chat template."""

    tokenizer: RustTokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token (text; "" if unset)
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: str | None


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 as itself, the rest from U+0100 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _respell(token: str, alphabet: set[str], spelling: dict[int, str]) -> str:
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _bpe(tokens: list[str], merges: list[str]) -> RustTokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {_respell(token, alphabet, spelling): i for i, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ConfigError(f"gguf: tokenizer.ggml.merges holds {merge!r}, not a pair 'a b'")
        pairs.append((left, right))
    return RustTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))


def _split(pre: str) -> pre_tokenizers.PreTokenizer:
    regex = SPLITS.get(pre)
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    single, special = "$A:0", []
    if add_bos and bos is not None:
        single = f"{tokens[bos]}:0 {single}"
        special.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single = f"{single} {tokens[eos]}:0"
        special.append((tokens[eos], eos))
    return processors.TemplateProcessing(single=single, special_tokens=special)


def gguf_vocab(f: GGUFFile) -> GGUFVocab:
    """The tokenizer and special tokens of a GGUF file; ConfigError for a vocabulary kind not supported."""
    kind = str(f.value("tokenizer.ggml.model", ""))
    if kind not in MODELS:
        raise ConfigError(
            f"gguf: tokenizer.ggml.model {kind!r} of {f.path.name} is not supported; "
            f"supported: {', '.join(MODELS)}"
        )
    tokens: list[str] = f.value("tokenizer.ggml.tokens")
    types: list[int] = f.value("tokenizer.ggml.token_type", None) or [1] * len(tokens)  # 1: normal
    tok = _bpe(tokens, f.value("tokenizer.ggml.merges"))
    tok.pre_tokenizer = _split(str(f.value("tokenizer.ggml.pre", "")))
    tok.decoder = decoders.ByteLevel()
    alphabet = set(byte_alphabet().values())
    # a control token spelled outside the byte alphabet is a llama.cpp mislabel, as transformers says
    control = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    ids = {
        k: f.value(f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos", "unknown", "padding", "eot")
    }
    tok.post_processor = _post_processor(
        tokens,
        ids["bos"],
        ids["eos"],
        bool(f.value("tokenizer.ggml.add_bos_token", False)),
        bool(f.value("tokenizer.ggml.add_eos_token", False)),
    )
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    special = {name: tokens[ids[k]] if ids[k] is not None else "" for name, k in names.items()}
    eos_ids = sorted({i for i in (ids["eos"], ids["eot"]) if i is not None})
    template = f.value("tokenizer.chat_template", None)
    return GGUFVocab(tok, special, ids["bos"], eos_ids, str(template) if template else None)
