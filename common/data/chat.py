"""The vision-language chat format: special tokens, template, tokenizer and assistant-only loss mask.

Template. A conversation is a list of turns `{"role": "system" | "user" | "assistant", "content": str}`;
it starts with a system or a user turn and holds at least one assistant turn. Each turn renders as

    <|{role}|>\\n{content}<|end|>\\n

and a prompt for generation ends with `<|assistant|>\\n`. So `[user "<image>\\nWhat colour?", assistant
"red"]` is the text

    <|user|>\\n<image>\\nWhat colour?<|end|>\\n<|assistant|>\\nred<|end|>\\n

There is no BOS token. `<|end|>` closes every turn and is the EOS: the model learns to stop by
predicting it after an answer. `<image>` in a content string (IMAGE_TOKEN, the same marker as
`data.synth_vqa.IMAGE_MARKER` and LLaVA-style conversation data) is where an image goes; in ids
the i-th marker of the conversation becomes `image_tokens[i]` copies of `image_token_id`, which the
model overwrites with the i-th image's projected features.

Special tokens (ids 0-5 in a tokenizer trained here): `<|pad|>` (pad), `<|end|>` (end of turn, EOS),
`<|system|>`, `<|user|>`, `<|assistant|>`, `<image>`. They only ever come from the template: text
(any content, even a user typing "<|end|>" or "<|assistant|>") is encoded with special-token
matching off, so it can never inject a turn boundary, an image slot or padding; only the literal
IMAGE_TOKEN marker in content becomes image ids.

Loss mask. `loss_mask[k]` is True when ids[k] is a training target (predicted from ids[:k]): the
content tokens of assistant turns and their `<|end|>`; False on role headers, the newlines between
turns, system and user turns and image tokens.

Ids equal what a Hugging Face tokenizer gives for the rendered text (`save()` writes a folder
`transformers.AutoTokenizer` loads, with this template as its `chat_template`) when there is no
image marker, or one image token per marker: text between special tokens is encoded as one
segment, exactly as `tokenizers` splits a string at its added tokens. (Exception: a foreign
tokenizer whose pre-tokenizer treats the first segment of a string differently, e.g. Metaspace with
prepend_scheme="first".)

`train_bpe` makes a byte-level BPE (every string encodes, no unknown token), deterministic;
`ChatTokenizer.load` also takes a foreign tokenizer folder (Llama 3, Qwen2, GPT-2, ...): the
special tokens above that it lacks are added, so its vocab grows (resize the embeddings) and its
own chat format is not used.

A ChatTokenizer pickles (DataLoader workers) and is safe to call from several processes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

PAD, END, SYSTEM, USER, ASSISTANT = "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = (PAD, END, SYSTEM, USER, ASSISTANT, IMAGE_TOKEN)
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
GENERATION_PROMPT = ASSISTANT + "\n"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens, no merges

# The template above in Jinja, for `transformers` (`apply_chat_template`) and any server reading
# tokenizer_config.json. A list content (the Hugging Face multimodal message form) renders its
# parts in order: {"type": "text", "text": ...} as the text, {"type": "image"} as the marker.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- else -%}{{- raise_exception('unsupported content part type: ' + part['type']) -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Pre-tokenization of trained tokenizers: words with at most one leading non-letter (" red", "'s"),
# single digits (so "12" is "1" "2": counts and numbers stay compositional), punctuation runs,
# newline runs and other whitespace, each chunk then BPE-merged over its UTF-8 bytes. A special
# token's text ("<|end|>", "<image>") always spans several chunks, so no learned token can equal it.
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FILES_OVERRIDING_CONFIG = ("chat_template.jinja", "chat_template.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ChatEncoding:
    ids: list[int]
    loss_mask: list[bool]

    def __len__(self) -> int:
        return len(self.ids)


def check_turns(turns, *, need_assistant: bool = True) -> None:
    """ValueError (one line) unless `turns` is a conversation the template accepts."""
    if not isinstance(turns, (list, tuple)) or not turns:
        raise ValueError("conversation has no turns")
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"turn {i} is not an object")
        if t.get("role") not in ROLES:
            raise ValueError(f"turn {i} has unknown role {t.get('role')!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(t.get("content"), str):
            raise ValueError(f"turn {i} ({t['role']}) content is not a string")
    if turns[0]["role"] == "assistant":
        raise ValueError("conversation starts with an assistant turn (expected system or user)")
    if need_assistant and not any(t["role"] == "assistant" for t in turns):
        raise ValueError("conversation has no assistant turn")


def render(turns, add_generation_prompt: bool = False) -> str:
    """The template as text (images as IMAGE_TOKEN markers): what CHAT_TEMPLATE renders."""
    text = "".join(f"<|{t['role']}|>\n{t['content']}{END}\n" for t in turns)
    return text + (GENERATION_PROMPT if add_generation_prompt else "")


def count_images(turns) -> int:
    return sum(t["content"].count(IMAGE_TOKEN) for t in turns)


def conversation_texts(meta) -> list[str]:
    """The text pieces of a conversation sample's json metadata (a dict, or its str/bytes): each
    turn's content split at the image markers, empty pieces dropped. ValueError when the json does
    not parse or the turns are not a conversation the template accepts."""
    if isinstance(meta, (bytes, str)):
        meta = json.loads(meta)
    if not isinstance(meta, dict):
        raise ValueError("json metadata is not an object")
    turns = meta.get("turns")
    check_turns(turns)
    return [p for t in turns for p in t["content"].split(IMAGE_TOKEN) if p]


def sample_texts(sample: dict) -> list[str]:
    """The texts of one shard sample ({ext: bytes}, as `ShardIndex.read` returns): its `txt` caption,
    then its conversation's pieces (`conversation_texts`) when its `json` has "turns". [] when it has
    neither; ValueError when its json does not parse or its turns are malformed."""
    out = []
    cap = sample.get("txt")
    if cap is not None:
        cap = (cap.decode("utf-8") if isinstance(cap, bytes) else str(cap)).strip()
        if cap:
            out.append(cap)
    raw = sample.get("json")
    if raw:
        meta = json.loads(raw)
        if isinstance(meta, dict) and "turns" in meta:
            out.extend(conversation_texts(meta))
    return out


def _image_counts(turns, image_tokens: int | Sequence[int]) -> list[int]:
    n = count_images(turns)
    if isinstance(image_tokens, int):
        counts = [image_tokens] * n
    else:
        counts = list(image_tokens)
        if len(counts) != n:
            raise ValueError(f"conversation has {n} image marker(s) but {len(counts)} image(s) were given")
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"image token counts must be positive ints, got {c!r}")
    return counts


class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the chat format of this module (see its docstring). Takes
    ownership of `tokenizer`: adds the special tokens it lacks and turns special-token matching off."""

    def __init__(self, tokenizer: Tokenizer):
        have = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        missing = [s for s in SPECIAL_TOKENS if s not in have]
        if missing:  # a foreign tokenizer: the vocab grows by these
            tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in missing])
        self._setup(tokenizer)

    def _setup(self, tokenizer: Tokenizer) -> None:
        tokenizer.encode_special_tokens = True  # text never matches special tokens (not pickled: see __setstate__)
        self._tok = tokenizer
        ids = {s: tokenizer.token_to_id(s) for s in SPECIAL_TOKENS}
        self.pad_id, self.end_id, self.image_token_id = ids[PAD], ids[END], ids[IMAGE_TOKEN]
        self._role_ids = {r: ids[tok] for r, tok in ROLE_TOKENS.items()}
        special = {t for t, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        self.special_ids = frozenset(special)
        self.vocab_size = max(max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1,
                              tokenizer.get_vocab_size(with_added_tokens=True))  # rows of the embedding
        self._newline = self.encode_text("\n")

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tok

    def __getstate__(self):
        return {"json": self._tok.to_str()}

    def __setstate__(self, state):
        self._setup(Tokenizer.from_str(state["json"]))

    # ------------------------------------------------------------------------------ encoding
    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids; special-token text stays text (no special id can come out)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.special_ids.intersection(ids):  # only possible with a foreign vocab holding such a string
            raise ValueError(f"text {text[:40]!r} tokenizes into a special token")
        return ids

    def _encode_content(self, content: str, images: Iterator[int], train: bool, ids: list, mask: list) -> None:
        """Append "\\n{content}" (the header's newline and the content as one segment, as a whole-string
        encode splits them) with image markers expanded; mask content tokens when `train`."""
        for k, piece in enumerate(content.split(IMAGE_TOKEN)):
            if k:
                ids.extend([self.image_token_id] * next(images))
                mask.extend([False] * (len(ids) - len(mask)))
            text = "\n" + piece if k == 0 else piece
            if not text:
                continue
            enc = self._tok.encode(text, add_special_tokens=False)
            if self.special_ids.intersection(enc.ids):
                raise ValueError(f"text {piece[:40]!r} tokenizes into a special token")
            ids.extend(enc.ids)
            skip = 1 if k == 0 else 0  # the newline closing the role header is not content
            mask.extend(train and end > skip for _, end in enc.offsets)

    def _encode(self, turns, image_tokens, train: bool) -> ChatEncoding:
        images = iter(_image_counts(turns, image_tokens))
        ids: list[int] = []
        mask: list[bool] = []
        for t in turns:
            learn = train and t["role"] == "assistant"
            ids.append(self._role_ids[t["role"]])
            mask.append(False)
            self._encode_content(t["content"], images, learn, ids, mask)
            ids.append(self.end_id)
            mask.append(learn)
            ids.extend(self._newline)
            mask.extend([False] * len(self._newline))
        return ChatEncoding(ids, mask)

    def encode_conversation(self, turns, image_tokens: int | Sequence[int]) -> ChatEncoding:
        """Ids and loss mask of a training conversation. The i-th image marker becomes image_tokens[i]
        image ids (an int: that many for every marker). ValueError (one line) on an empty turn list,
        an unknown role, a non-string content, a first turn that is not system/user, no assistant
        turn, or as many markers as images given not matching."""
        check_turns(turns)
        return self._encode(turns, image_tokens, train=True)

    def encode_prompt(self, turns, image_tokens: int | Sequence[int]) -> list[int]:
        """Ids of `turns` (usually ending with a user turn) followed by the generation prompt
        `<|assistant|>\\n`: what generation continues from, until it emits `end_id`."""
        check_turns(turns, need_assistant=False)
        ids = self._encode(turns, image_tokens, train=False).ids
        return ids + [self._role_ids["assistant"]] + self._newline

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    render = staticmethod(render)

    # ------------------------------------------------------------------------------ files
    @classmethod
    def load(cls, folder: str | os.PathLike) -> ChatTokenizer:
        """A local Hugging Face tokenizer folder (tokenizer.json; tokenizer_config.json and any chat
        template in it are not needed: the format is this module's). FileNotFoundError (one line)
        when the folder or its tokenizer.json is missing."""
        folder = os.fspath(folder)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"tokenizer folder {folder!r} does not exist" if not os.path.exists(folder)
                                    else f"tokenizer path {folder!r} is not a folder")  # fmt: skip
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            hint = (" (it holds a slow tokenizer: convert it with transformers' AutoTokenizer.from_pretrained(...)"
                    ".save_pretrained(...))" if os.path.exists(os.path.join(folder, "tokenizer.model")) else "")
            raise FileNotFoundError(f"tokenizer folder {folder!r} has no tokenizer.json{hint}")
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
            raise ValueError(f"cannot read {path!r}: {e}") from None
        return cls(tok)

    def save(self, folder: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast, eos/pad tokens and
        CHAT_TEMPLATE) so that `transformers.AutoTokenizer.from_pretrained(folder)` loads it with this
        chat format. Removes chat_template.jinja/.json and special_tokens_map.json left in the folder
        by another tokenizer, since transformers would prefer them to the config."""
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": END,
            "pad_token": PAD,
            "unk_token": None,
            "extra_special_tokens": {"image_token": IMAGE_TOKEN},
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "chat_template": CHAT_TEMPLATE,
        }
        for name in _FILES_OVERRIDING_CONFIG:
            if os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
        _write(os.path.join(folder, "tokenizer.json"), self._tok.to_str(pretty=True) + "\n")
        _write(os.path.join(folder, "tokenizer_config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n")

    def __repr__(self) -> str:
        return (f"ChatTokenizer(vocab_size={self.vocab_size}, end_id={self.end_id}, "
                f"image_token_id={self.image_token_id})")


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> ChatTokenizer:
    """A byte-level BPE over `texts` with the special tokens at ids 0-5, at most `vocab_size` tokens
    (fewer when the texts hold fewer merges seen at least `min_frequency` times). Deterministic: the
    same texts give a byte-identical tokenizer.json. Texts should not hold image markers
    (`sample_texts` splits them out)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
                         f"special tokens), got {vocab_size!r}")  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return ChatTokenizer(tok)
