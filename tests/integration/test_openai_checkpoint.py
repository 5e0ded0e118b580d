"""A real checkpoint behind the OpenAI API: a tiny Llama saved with transformers, a byte-level BPE
tokenizer trained here with `tokenizers`, and a chat template in tokenizer_config.json; served by
the real router over real engines in this process (1 PREFILL + 1 GENERATION) and chatted with
through the openai SDK. The served name is the checkpoint directory's; the chat prompt is the
template's rendering; greedy replies equal the offline LLM.chat's."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from openai_server import ServerThread  # noqa: E402
from test_model_tokenizer import byte_level_dir  # noqa: E402

from cluster.deploy.serve import load_tokenizer, served_model_name  # noqa: E402
from cluster.router.instance_client import LocalInstanceClient  # noqa: E402
from worker.engine_types import EngineConfig  # noqa: E402
from worker.instance import Instance, InstanceSpec  # noqa: E402
from worker.llm import LLM  # noqa: E402
from worker.protocol import InstanceRole  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.tokenizer import chat_prompt_ids  # noqa: E402

VOCAB = 416
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = byte_level_dir(tmp_path_factory.mktemp("ckpt") / "tiny-chat")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory


def test_a_tiny_llama_chats_through_the_sdk(checkpoint: Path) -> None:
    tokenizer = load_tokenizer(str(checkpoint))
    name = served_model_name(str(checkpoint), None)
    assert name == "tiny-chat"
    instances: list[Instance] = []

    async def engines(router):
        for instance_id, role in (("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION)):
            spec = InstanceSpec(
                instance_id, EngineConfig(role=role, num_blocks=128, tokens_per_block=16), model=str(checkpoint),
                dtype="float32", device="cpu", cluster_token="checkpoint-test-token-0123456789", torch_threads=1,
            )  # fmt: skip
            instance = Instance(spec)
            instances.append(instance)
            await router.add_instance(LocalInstanceClient(instance))

        async def shutdown():
            for instance in instances:
                instance.shutdown()

        return shutdown

    with ServerThread(instances=engines, tokenizer=tokenizer, vocab_size=VOCAB, max_seq_len=512, served_model_name=name) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny-chat"]
        chat = client.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        streamed = list(
            client.chat.completions.create(
                model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
        )
    assert chat.model == "tiny-chat" and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    offline = LLM(str(checkpoint), dtype="float32", device="cpu").chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert chat.choices[0].message.content == offline[0].text
