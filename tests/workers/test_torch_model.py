"""Building the policy model and tokenizer from ModelConfig, and loading them back."""

import msgspec
import pytest
import torch

from dynarl.api.config import ModelConfig
from dynarl.workers.tokenizer import build_tokenizer, load_tokenizer
from dynarl.workers.torch.model import build_model, save_pretrained

TEXT = "Q: 12+30=?\nA: 42. (done)"


def test_tokenizer_round_trips_text_and_has_special_tokens() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT)  # one token per character, spaces included
    assert tokenizer.decode(ids) == TEXT
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    assert tokenizer.decode([tokenizer.bos_token_id, *ids]).removeprefix("<bos>") == TEXT


def test_random_init_is_a_function_of_the_seed_alone() -> None:
    config = ModelConfig()
    torch.manual_seed(123)
    before = torch.rand(1)
    a = build_model(config, seed=0)
    b = build_model(config, seed=0)
    c = build_model(config, seed=1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the global RNG was left alone
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    assert a.config.vocab_size == len(build_tokenizer())
    assert a.config.num_hidden_layers == config.num_layers
    assert not a.training


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_saved_checkpoint_loads_through_from_pretrained(tmp_path: object, arch: str) -> None:
    config = ModelConfig(arch=arch, hidden_size=32, num_heads=4, num_kv_heads=2)
    model = build_model(config, seed=3)
    tokenizer = load_tokenizer(config)
    save_pretrained(model, tokenizer, str(tmp_path))

    loaded_config = msgspec.structs.replace(config, path=str(tmp_path))
    loaded = build_model(loaded_config, seed=99)  # the seed is irrelevant for a checkpoint
    loaded_tokenizer = load_tokenizer(loaded_config)

    assert type(loaded) is type(model)
    ids = torch.tensor([loaded_tokenizer.encode(TEXT)])
    assert loaded_tokenizer.decode(ids[0].tolist()) == TEXT
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_a_checkpoints_skeleton_builds_on_the_meta_device(tmp_path: object) -> None:
    config = ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2)
    model = build_model(config, seed=3)
    save_pretrained(model, load_tokenizer(config), str(tmp_path))
    with torch.device("meta"):  # how a trainer joiner builds its model
        skeleton = build_model(msgspec.structs.replace(config, path=str(tmp_path)))
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    assert [(n, p.shape) for n, p in skeleton.named_parameters()] == shapes
    assert all(p.device.type == "meta" for p in skeleton.parameters())


def test_the_chat_tokenizer_has_one_id_per_chat_token_and_a_template(tmp_path: object) -> None:
    tokenizer = build_tokenizer(chat=True)
    ids = tokenizer.encode("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert len(ids) == 5 and tokenizer.eos_token == "<|im_end|>"
    assert ids[-1] == tokenizer.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.save_pretrained(str(tmp_path))  # a checkpoint keeps both
    loaded = load_tokenizer(ModelConfig(path=str(tmp_path)))
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.eos_token_id == tokenizer.eos_token_id


def test_a_random_init_model_has_the_vocabulary_of_the_tokenizer_its_config_names() -> None:
    """Every worker builds the model from the config alone (the trainer without a
    tokenizer at hand): with ``model.tokenizer=chat`` its embedding has the chat
    tokenizer's rows, as the engines' (built with the tokenizer) do."""
    config = ModelConfig(tokenizer="chat", num_layers=1, hidden_size=32)
    rows = build_model(config, seed=0).get_input_embeddings().weight.shape[0]
    assert rows == len(build_tokenizer(chat=True)) > len(build_tokenizer())
    with_tokenizer = build_model(config, seed=0, tokenizer=load_tokenizer(config))
    assert with_tokenizer.get_input_embeddings().weight.shape[0] == rows
