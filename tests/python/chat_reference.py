#!/usr/bin/env python3
"""Reference ChatML renderings from `transformers`' apply_chat_template for the C++ chat test.

Writes a JSON list to --out; every case holds the messages, the token set ("qwen2"/"qwen3"), the
chat format ("qwen3": no default system message, "qwen2": the Qwen2 default system message), and
what transformers produces:
  ids, mask        apply_chat_template(..., return_assistant_tokens_mask=True) with a ChatML
                   template whose assistant content + <|im_end|> is a {% generation %} block
  text             the rendered text
  prompt_ids       the same messages with add_generation_prompt=True
  config_ids       (qwen2 format only) ids from the vocabulary's own tokenizer_config.json
                   template, which inserts "<|im_start|>assistant\\n" after every user turn
"""
import argparse
import json
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
from tokenizer_reference import load_hf  # noqa: E402

# ChatML as Qwen3 instruct models use it, without a default system message.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same with Qwen2's default system message.
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    + QWEN3_TEMPLATE
)

CONVERSATIONS = {
    "single_turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 = 4."},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "You are a terse math tutor."},
        {"role": "user", "content": "Factor x^2 - 1."},
        {"role": "assistant", "content": "(x - 1)(x + 1)"},
        {"role": "user", "content": "And x^2 - 4?"},
        {"role": "assistant", "content": "(x - 2)(x + 2)"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ],
    "multilingual_code": [
        {"role": "user", "content": "用 Python 写一个函数，返回列表的和。😀"},
        {"role": "assistant",
         "content": "```python\ndef total(xs):\n    return sum(xs)\n```\n这个函数返回列表的和。"},
        {"role": "user", "content": "Und auf Deutsch?\n"},
        {"role": "assistant", "content": "Die Funktion gibt die Summe zurück.  "},
    ],
    "leading_whitespace": [
        {"role": "user", "content": "  indented question"},
        {"role": "assistant", "content": "\n\nStarts with blank lines."},
        {"role": "user", "content": "\tTab"},
        {"role": "assistant", "content": " Starts with a space.\n"},
    ],
    "think_tokens": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant",
         "content": "<think>\n91 = 7 * 13.\n</think>\n\nNo, 91 = 7 × 13."},
    ],
    "non_nfc_and_specials": [
        {"role": "system", "content": "Cafe\u0301 rules."},
        {"role": "user", "content": "Say <|endoftext|> literally?"},
        {"role": "assistant", "content": "e\u0301 is normalised; <|endoftext|> is one token."},
    ],
    "ends_with_user": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
}


def render(tok, template, messages):
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    prompt = tok.apply_chat_template(messages, chat_template=template, tokenize=True,
                                     return_dict=True, add_generation_prompt=True)
    ids = list(out["input_ids"])
    if ids != tok.encode(text, add_special_tokens=False):
        sys.exit("apply_chat_template ids differ from encode(text)")
    return {"ids": ids, "mask": list(out["assistant_masks"]), "text": text,
            "prompt_ids": list(prompt["input_ids"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    qwen2 = load_hf(args.tokenizer, qwen3=False)
    qwen3 = load_hf(args.tokenizer, qwen3=True)
    cases = []
    for name, messages in CONVERSATIONS.items():
        for fmt, tok_name, tok, template in (("qwen3", "qwen3", qwen3, QWEN3_TEMPLATE),
                                             ("qwen2", "qwen2", qwen2, QWEN2_TEMPLATE)):
            case = {"name": name, "format": fmt, "tokenizer": tok_name, "messages": messages}
            case.update(render(tok, template, messages))
            if fmt == "qwen2":  # the vocabulary's own template, no generation tags
                case["config_ids"] = list(tok.apply_chat_template(
                    messages, tokenize=True, return_dict=True)["input_ids"])
            cases.append(case)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(cases)} chat cases to {args.out}")


if __name__ == "__main__":
    main()
