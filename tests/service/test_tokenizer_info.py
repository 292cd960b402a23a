"""Special tokens and chat templates read from a Hugging Face directory where transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

from service.tokenizers import hf_tokenizer_info


def test_added_token_dicts_and_named_templates(tmp_path: Path) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    info = hf_tokenizer_info(tmp_path, bos_id=1, eos_id=2)
    assert (info.bos_token, info.eos_token, info.pad_token) == ("<s>", "</s>", None)
    assert (info.bos_token_id, info.eos_token_id, info.chat_template) == (1, 2, "D")


def test_a_chat_template_file_wins_and_no_config_is_no_template(tmp_path: Path) -> None:
    assert hf_tokenizer_info(tmp_path, bos_id=None, eos_id=None).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old"}))
    (tmp_path / "chat_template.jinja").write_text("new")
    assert hf_tokenizer_info(tmp_path, bos_id=None, eos_id=None).chat_template == "new"
