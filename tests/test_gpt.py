"""The GPT example through ``engine.fit``: N workers end where 1 does, the loss falls, and a
module that compiles its blocks trains like the eager one and leaves checkpoints with eager
names (``compile_in_place``), loadable either way."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import pytest
import torch

from ringflow.engine import DatasetData, TrainConfig, fit
from ringflow.engine.module import compile_in_place, compiled_in_buckets
from ringflow.models.gpt import (
    GPT,
    GPTConfig,
    GPTModule,
    TokenWindows,
    stdlib_tokens,
    warmup_cosine,
)
from ringflow.storage.checkpoint import read_checkpoint
from tests.support.fitting import relative_difference

BLOCK, BATCH, EPOCHS = 32, 8, 2
HPARAMS = {"preset": "tiny", "overrides": {"block_size": BLOCK}, "lr": 3e-3, "warmup_steps": 2}


@pytest.fixture(scope="module")
def corpus() -> DatasetData:
    tokens = stdlib_tokens(max_tokens=40 * BLOCK + 1 + 8 * BLOCK)
    train, validation = tokens[: 40 * BLOCK + 1], tokens[40 * BLOCK :]
    return DatasetData(train=TokenWindows(train, BLOCK), validation=TokenWindows(validation, BLOCK))


def trained(tmp_path, data, *, workers: int = 1, name: str = "eager", **hparams):
    return fit(
        GPTModule,
        hparams={**HPARAMS, **hparams},
        data=data,
        config=TrainConfig(workers=workers, epochs=EPOCHS, batch_size=BATCH, seed=5),
        checkpoint_uri=str(tmp_path / f"{name}-{workers}"),
        in_process=workers == 1,
    )


@pytest.fixture(scope="module")
def eager(tmp_path_factory, corpus):
    return trained(tmp_path_factory.mktemp("eager"), corpus)


def test_gpt2_small_has_gpt2s_size():
    model = GPT(GPTConfig.preset("gpt2_small"))
    assert round(model.num_params() / 1e6, 2) == 123.69  # nanoGPT's count for GPT-2 small
    assert model.flops_per_token(1024) == 6 * model.num_params() + 12 * 12 * 768 * 1024


def test_bad_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match=r"unknown GPTConfig fields \['layers'\]"):
        GPTConfig.preset("tiny", layers=3)
    with pytest.raises(ValueError, match="n_head .3. must divide n_embd .64."):
        GPTConfig.preset("tiny", n_head=3)
    with pytest.raises(ValueError, match="block_size"):
        GPT(GPTConfig.preset("tiny", block_size=8))(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match='compile must be False, True, "blocks" or "model"'):
        GPTModule(compile="all")


def test_windows_are_the_next_tokens_of_the_sorted_stdlib():
    tokens = stdlib_tokens(max_tokens=1000)
    assert torch.equal(tokens, stdlib_tokens(max_tokens=2000)[:1000])  # a prefix, by path
    windows = TokenWindows(tokens, 10)
    x, y = windows[3]
    assert len(windows) == 99
    assert torch.equal(x, tokens[30:40].long())
    assert torch.equal(y, tokens[31:41].long())
    with pytest.raises(IndexError):
        windows[99]


def test_warmup_then_cosine_to_the_floor():
    factors = [warmup_cosine(s, warmup=4, total=20, min_ratio=0.1) for s in range(25)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert factors[20:] == [0.1] * 5


def test_loss_falls(eager):
    first, last = eager.history[0].metrics, eager.history[-1].metrics
    assert last["train_loss"] < first["train_loss"] - 0.3
    assert last["val_loss"] < first["val_loss"]


def test_two_workers_end_with_one_workers_weights(eager, corpus, tmp_path, ray_session):
    two = trained(tmp_path, corpus, workers=2)
    assert relative_difference(two.state_dict, eager.state_dict) < 1e-5


def test_compiled_blocks_train_as_eager_with_eager_names(eager, corpus, tmp_path):
    compiled = trained(tmp_path, corpus, name="compiled", compile=True, compile_backend="aot_eager")
    assert relative_difference(compiled.state_dict, eager.state_dict) < 1e-4
    saved = read_checkpoint(compiled.checkpoint).state_dict
    assert not [k for k in saved if "_orig_mod" in k]
    GPTModule(**HPARAMS).load_state_dict(saved, strict=True)  # into an eager module
    module = GPTModule(**HPARAMS, compile=True, compile_backend="aot_eager")
    module.configure_model()
    assert compile_in_place(module) == 2  # one per block
    module.load_state_dict(read_checkpoint(eager.checkpoint).state_dict, strict=True)


def test_a_compiled_blocks_gradients_arrive_before_the_previous_blocks_backward_ends():
    """Gradient hooks fire per compiled block: every gradient of block i is accumulated (and
    its bucket can start) before block i - 1's backward has produced the gradient of its
    input, so the last blocks' all-reduces overlap the first blocks' backward."""
    module = GPTModule(
        "tiny", {"n_layer": 3, "block_size": 16}, compile=True, compile_backend="aot_eager"
    )
    module.configure_model()
    compile_in_place(module)
    events: list[tuple[str, int]] = []
    for index, block in enumerate(module.model.blocks):
        for param in block.parameters():
            param.register_post_accumulate_grad_hook(lambda _, i=index: events.append(("p", i)))
    ids = torch.randint(0, 256, (2, 16))
    x = module.model.wte(ids) + module.model.wpe(torch.arange(16))
    x.register_hook(lambda grad: events.append(("input of", 0)))
    for index, block in enumerate(module.model.blocks):
        x = block(x)
        x.register_hook(lambda grad, i=index + 1: events.append(("input of", i)))
    x.sum().backward()
    for index in (2, 1):
        last_gradient = max(n for n, event in enumerate(events) if event == ("p", index))
        assert last_gradient < events.index(("input of", index - 1))


def test_compile_in_place_keeps_the_wrappers_compiler_and_the_eager_names():
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph, inputs):  # a compiler of one's own: records what it is given
        graphs.append(graph)
        return graph.forward

    torch.manual_seed(0)
    block = GPT(GPTConfig.preset("tiny", n_layer=1)).blocks[0]  # a forward of one's own
    head = torch.nn.Sequential(torch.nn.Linear(64, 2))  # torch's forward
    eager = torch.nn.Sequential(block, head)
    x = torch.randn(2, 8, 64)
    expected = eager(x)
    wrapped = torch.nn.Sequential(
        torch.compile(block, backend=backend), torch.compile(head, backend=backend)
    )
    assert "1._orig_mod.0.weight" in wrapped.state_dict()
    assert compile_in_place(wrapped) == 2
    assert list(wrapped.state_dict()) == list(eager.state_dict())
    assert torch.allclose(wrapped(x), expected, atol=1e-6)
    assert len(graphs) == 2  # each ran through the wrapper's own compiler


def _backward_in_pieces(*, split: bool) -> tuple[int, list[str]]:
    """A GPT compiled whole (as ``engine.fit``'s workers hold it), run forward with or
    without ``compiled_in_buckets``: how many compiled backward nodes its loss has, and in
    what order its last block's gradients and those nodes' starts come during backward."""
    torch._dynamo.reset()  # a new module of the same class would reuse the last graphs
    module = GPTModule(
        "tiny",
        {"n_layer": 3, "n_embd": 256, "n_head": 4, "block_size": 16},
        compile="model",
        compile_backend="aot_eager",
    )
    module.configure_model()
    compile_in_place(module)
    events: list[str] = []
    for param in module.model.blocks[-1].parameters():
        param.register_post_accumulate_grad_hook(lambda _: events.append("last block's gradient"))
    ids = torch.randint(0, 256, (2, 16))
    # A block is 3 MiB of float32 weights: buckets of 2 MiB end inside every block.
    with compiled_in_buckets(2 << 20) if split else contextlib.nullcontext():
        loss = module.model(ids).float().square().mean()
    nodes, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            nodes.append(node)
            node.register_prehook(lambda *_: events.append("a compiled backward starts"))
        todo += [child for child, _ in node.next_functions]
    loss.backward()
    return len(nodes), events


def test_a_model_compiled_whole_gives_its_last_gradients_before_its_first_layers_backward():
    """Compiled whole, a model's backward is one node: every gradient appears at its end and
    no bucket could start before. In a worker's step (``compiled_in_buckets``) the graph is
    split where buckets end, as dynamo splits it for DDP: the last block's gradients are
    accumulated (its buckets start) before the backward of the model's first piece begins."""
    pieces, events = _backward_in_pieces(split=False)
    assert pieces == 1
    assert events[0] == "a compiled backward starts"
    pieces, events = _backward_in_pieces(split=True)
    assert pieces > 2
    last_start = max(i for i, event in enumerate(events) if event == "a compiled backward starts")
    assert events.count("last block's gradient") == 6  # 2 LayerNorms, 4 matrices, no biases
    assert max(i for i, e in enumerate(events) if e == "last block's gradient") < last_start


class SplitWatchingGPT(GPTModule):
    """Records, at each training step, the bucket size dynamo would split compiled graphs at."""

    caps: ClassVar[list[int]] = []

    def training_step(self, batch, batch_idx):
        from torch.nn.parallel import DistributedDataParallel

        self.caps.append(DistributedDataParallel._get_active_ddp_module().bucket_bytes_cap)
        return super().training_step(batch, batch_idx)


def test_a_model_compiled_whole_trains_as_eager_with_eager_names(corpus, tmp_path):
    """Through ``engine.fit``, split at its 1 MiB buckets: the same weights as eager, eager
    names."""
    hparams = {**HPARAMS, "overrides": {"block_size": BLOCK, "n_embd": 128, "n_head": 4}}
    config = TrainConfig(workers=1, epochs=EPOCHS, batch_size=BATCH, seed=5, bucket_mb=1.0)
    runs = {
        name: fit(
            module,
            hparams={**hparams, **extra},
            data=corpus,
            config=config,
            checkpoint_uri=str(tmp_path / name),
            in_process=True,  # the steps run here: SplitWatchingGPT.caps fills
        )
        for name, module, extra in (
            ("eager", GPTModule, {}),
            ("whole", SplitWatchingGPT, {"compile": "model", "compile_backend": "aot_eager"}),
        )
    }
    assert set(SplitWatchingGPT.caps) == {1 << 20}
    assert relative_difference(runs["whole"].state_dict, runs["eager"].state_dict) < 1e-4
    saved = read_checkpoint(runs["whole"].checkpoint).state_dict
    GPTModule(**hparams).load_state_dict(saved, strict=True)  # into an eager module
