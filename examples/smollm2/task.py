"""The task of the SmolLM2 check: the texts (texts/), the prompt and its
layout, and the question sets with their reference answers.

The prompt is the long-context analogue of the paper's video QA: system
text and instruction, then a long document (the "visual" tokens, cut into
32-token windows), then the question (text).
"""

from __future__ import annotations

import os

from mixkv import Segment, TokenKind, TokenLayout

HERE = os.path.dirname(os.path.abspath(__file__))
TEXTS = os.path.join(HERE, "texts")
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
INSTRUCTION = "<|im_start|>user\nRead the document below, then answer the question after it.\n\n"
WINDOW = 32


def read_text(name: str) -> str:
    with open(os.path.join(TEXTS, name), encoding="utf-8") as f:
        return f.read().strip("\n")


class Prompt:
    """(instruction text, document = "visual" tokens, question text)."""

    def __init__(self, tok, document: str, question: str, answer: str):
        self.head = tok.encode(SYSTEM + INSTRUCTION)
        self.document = tok.encode(document)
        self.tail = tok.encode("\n\nQuestion: " + question + "<|im_end|>\n<|im_start|>assistant\n")
        self.ids = self.head + self.document + self.tail
        self.layout = TokenLayout(
            [
                Segment(TokenKind.Text, len(self.head)),
                Segment(TokenKind.Visual, len(self.document)),
                Segment(TokenKind.Text, len(self.tail)),
            ]
        )
        self.answer = tok.encode(answer)


# Questions about the same document, each with its own reference answer
# (texts/): (name, file, when it was written). The held-out and test sets
# chose TARGET_FLOOR_BUDGET; the confirmation set was written after that and
# scored once (docs/real-model.md).
QUESTION_SETS = (
    ("held-out", "heldout_questions.txt", "written after alpha 8 and the 0.225x budget were fixed"),
    ("test", "test_questions.txt", "written before any measurement of the budget rule"),
    ("confirmation", "confirm_questions.txt", "written after the 0.275x budget was chosen on the two sets above"),
)


def read_questions(name: str):
    """(question, answer) pairs of texts/<name>: blocks split by "---"
    lines, each a "Q: " line and an "A: " line."""
    pairs = []
    for block in read_text(name).split("\n---\n"):
        lines = dict(line.split(": ", 1) for line in block.strip().splitlines())
        pairs.append((lines["Q"], lines["A"]))
    return pairs
