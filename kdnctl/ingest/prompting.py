"""How a document and a question are laid out as tokens.

The stored KV must be a prefix of what an engine later runs, so the document is prefilled as
``header + document`` where the header is the chat template's part before the user's content,
and a question becomes a suffix: the rest of the user turn plus the assistant's opening. A full
prefill of ``header + document + suffix`` is therefore exactly what the cache saves.
"""

from __future__ import annotations

from dataclasses import dataclass

_SENTINEL = "\x00KDNCTL-CONTENT\x00"
QUESTION_TEMPLATE = "\n\nAnswer the question using the document above. Reply with a short answer only.\nQuestion: {question}"


@dataclass(frozen=True)
class PromptFormat:
    header: str
    tail: str

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "PromptFormat":
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
            )
            if _SENTINEL in rendered:
                header, tail = rendered.split(_SENTINEL, 1)
                return cls(header, tail)
        return cls("", "\nAnswer:")

    def header_ids(self, tokenizer) -> list[int]:
        ids = tokenizer(self.header, add_special_tokens=True).input_ids if self.header else []
        if not ids and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id]
        return list(ids)

    def document_ids(self, tokenizer, text: str) -> tuple[list[int], int]:
        """Token ids of header + document, and the number of header tokens."""
        header = self.header_ids(tokenizer)
        body = tokenizer(text, add_special_tokens=False).input_ids
        return header + list(body), len(header)

    def question_ids(self, tokenizer, question: str) -> list[int]:
        text = QUESTION_TEMPLATE.format(question=question.strip()) + self.tail
        return list(tokenizer(text, add_special_tokens=False).input_ids)
