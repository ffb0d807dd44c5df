"""The render server works in a process where ``import vllm`` fails."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
sys.modules["vllm"] = None  # any `import vllm...` now raises ImportError
from fastapi.testclient import TestClient
from vllm_pd_ext.render_server.app import create_app
from vllm_pd_ext.render_server.settings import RenderSettings
from vllm_pd_ext.render_server.tokenizer import load_tokenizer

app = create_app(RenderSettings(model=sys.argv[1], max_model_len=256))
with TestClient(app) as c:
    r = c.post("/v1/chat/completions/render",
               json={"messages": [{"role": "user", "content": "hi ü"}], "max_tokens": 4})
    ids = r.json()["token_ids"]
    d = c.post("/v1/chat/completions/derender",
               json={"generate_response": {"choices": [{"token_ids": ids[-5:]}]}})
    print(json.dumps({"render": r.status_code, "derender": d.status_code,
                      "text": d.json()["choices"][0]["message"]["content"],
                      "fast_bpe": load_tokenizer(sys.argv[1], None).fast_bpe is not None,
                      "vllm_loaded": any(m == "vllm" or m.startswith("vllm.")
                                         for m, v in sys.modules.items() if v is not None)}))
"""


def test_render_and_derender_without_vllm(tiny_qwen):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_qwen)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["render"] == 200 and result["derender"] == 200
    # <|im_end|> is the eos (a special id, skipped); <|im_start|> is not in all_special_ids
    assert result["text"] == "\n<|im_start|>assistant\n"
    assert result["vllm_loaded"] is False
    assert result["fast_bpe"] is True  # the tiktoken fast path needs no vLLM either
