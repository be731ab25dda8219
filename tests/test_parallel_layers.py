"""Tensor parallelism's layers and loader: every rank's shard, each in its own process, against one process.

The ranks are real processes (spawned, never forked) in one gloo group; each loads its shard of a
checkpoint made by transformers, runs the model over a paged KV cache of its own KV heads, and sends
back its logits and its cache. Every rank must have the whole model's logits, and its cache must hold
its heads' slice of the whole model's cache.
"""

import queue
import shutil
import time
import traceback
from datetime import timedelta
from pathlib import Path

import helpers_tolerances as tolerances
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers_checkpoints import save_random_checkpoints

from minipaged.models import AttentionMetadata, load_config, load_model
from minipaged.models import parallel as parallel_module
from minipaged.models.config import ModelConfig
from minipaged.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
    check_tensor_parallel,
    kv_heads_of_rank,
    load_model_shard,
    num_kv_heads_per_rank,
    shard_config,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from minipaged.stage2_block_table import PagedKVCache
from minipaged.stage4_reference_attention import paged_attention_ref

pytestmark = pytest.mark.common

VOCAB = 97  # a multiple of neither 2 nor 4: the last rank's slice of the vocabulary is padded
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
ARCHITECTURES = {  # name -> (transformers class name, its config's arguments)
    "llama-mha-bias": ("LlamaConfig", {**COMMON, "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    "llama-gqa": ("LlamaConfig", COMMON),  # 2 KV heads: split at tp 2
    "llama-replicated": ("LlamaConfig", {**COMMON, "num_attention_heads": 8}),  # 2 KV heads over 4 ranks
    "qwen2": ("Qwen2Config", {**COMMON, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {**COMMON, "num_key_value_heads": 1, "head_dim": 32}),  # 1 KV head over 2 ranks
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                eos_token_id=0)),
}
POOL_SIZE = 4  # ranks in the pool; a case of tp ranks runs on ranks 0 .. tp - 1
RESULT_TIMEOUT_S = 60  # a case's ranks answer within this, or the pool is torn down and the case fails
COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # a rank waiting for another that is gone gives up after this

BLOCK_SIZE, NUM_BLOCKS = 4, 6
BLOCK_TABLES = [[3, 1], [4, 0]]  # sequence 0 in blocks 3 then 1, sequence 1 in block 4 (0: padding)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_random_checkpoints(tmp_path_factory, ARCHITECTURES)


def steps(vocab: int) -> list[dict]:
    """Two forward passes over two sequences: a prefill of 5 and 3 tokens (ids from both ends of the
    vocabulary, so that the first and the last rank's slices are read), then one decode token each."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[0, vocab - 1, *torch.randint(0, vocab, (3,), generator=gen).tolist()],
               [vocab - 2, *torch.randint(0, vocab, (2,), generator=gen).tolist()]]
    decoded = [vocab - 1, 1]

    def slots(seq: int, positions: range) -> list[int]:
        table = BLOCK_TABLES[seq]
        return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]

    prefill = dict(input_ids=prompts[0] + prompts[1], positions=[*range(5), *range(3)],
                   slot_mapping=slots(0, range(5)) + slots(1, range(3)), seq_lens=[5, 3], query_start_loc=[0, 5, 8])
    decode = dict(input_ids=decoded, positions=[5, 3], slot_mapping=slots(0, range(5, 6)) + slots(1, range(3, 4)),
                  seq_lens=[6, 4], query_start_loc=None)
    return [prefill, decode]


CONTEXT = 6  # the longest context of steps()


def run(model, config: ModelConfig, num_kv_heads: int) -> tuple[list[torch.Tensor], PagedKVCache]:
    """``steps()`` through ``model``, over a fresh cache of ``num_kv_heads`` heads: the logits of every
    token of each step, and the cache."""
    cache = PagedKVCache(config.num_layers, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, config.head_dim)
    logits = []
    for step in steps(config.vocab_size):
        start = step["query_start_loc"]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step["slot_mapping"], dtype=torch.int64),
            block_tables=torch.tensor(BLOCK_TABLES, dtype=torch.int32),
            seq_lens=torch.tensor(step["seq_lens"], dtype=torch.int32),
            query_start_loc=None if start is None else torch.tensor(start, dtype=torch.int32),
            backend=paged_attention_ref)
        with torch.no_grad():
            hidden = model(torch.tensor(step["input_ids"]), torch.tensor(step["positions"]), cache, meta)
            logits.append(model.compute_logits(hidden))
    return logits, cache


def run_shard(path: str, rank: int, tp: int, process_group) -> dict:
    """One rank's case: its shard, run over a cache of its KV heads; numpy arrays, to travel by value."""
    model, config = load_model_shard(path, rank=rank, world_size=tp, process_group=process_group)
    logits, cache = run(model, config, num_kv_heads_per_rank(config, tp))
    return {"logits": [t.numpy() for t in logits], "key_cache": [t.numpy() for t in cache.key_cache],
            "value_cache": [t.numpy() for t in cache.value_cache]}


def rank_main(rank: int, world_size: int, store: str, tasks, results) -> None:
    """A rank of the pool: joins the group, then runs the cases it is sent until it is sent None."""
    torch.set_num_threads(1)  # several ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        # new_group is collective: every rank makes every group, even one it is not in
        groups = {2: dist.new_group([0, 1], timeout=COLLECTIVE_TIMEOUT), world_size: None}
        while True:
            try:
                task = tasks.get(timeout=300)  # the test process is gone if no case comes for this long
            except queue.Empty:
                return
            if task is None:
                return
            path, tp = task
            try:
                results.put((rank, True, run_shard(path, rank, tp, groups[tp])))
            except Exception:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``POOL_SIZE`` spawned processes in one gloo group, reused across cases (each costs a Python and a
    torch start). A case that fails or times out tears the pool down; the next case starts a new one."""

    def __init__(self, store_dir: Path) -> None:
        self.store_dir, self.started, self.processes = store_dir, 0, []

    def start(self) -> None:
        context = mp.get_context("spawn")
        self.started += 1
        store = self.store_dir / f"store{self.started}"  # a FileStore file, new for each pool
        self.tasks = [context.Queue() for _ in range(POOL_SIZE)]
        self.results = context.Queue()
        self.processes = [context.Process(target=rank_main, args=(rank, POOL_SIZE, str(store), self.tasks[rank],
                                                                  self.results), daemon=True)
                          for rank in range(POOL_SIZE)]
        for process in self.processes:
            process.start()

    def run(self, path: Path, tp: int) -> list[dict]:
        """Every rank's result for one case of ``tp`` ranks, in rank order."""
        if not self.processes:
            self.start()
        for rank in range(tp):
            self.tasks[rank].put((str(path), tp))
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(answers) < tp:
            try:
                rank, ok, answer = self.results.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in self.processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(wait_s=0)
                    pytest.fail(f"the ranks did not answer in {RESULT_TIMEOUT_S} s"
                                if not dead else f"a rank ended (exit codes {dead}) before answering")
                continue
            if not ok:
                self.close(wait_s=0)  # the other ranks may wait in a collective for the one that failed
                pytest.fail(f"rank {rank} of {tp} failed:\n{answer}")
            answers[rank] = answer
        return [answers[rank] for rank in range(tp)]

    def close(self, wait_s: float = 10) -> None:
        """Ask every rank to stop, wait ``wait_s`` seconds for them all, and end those that have not."""
        for process, tasks in zip(self.processes, self.tasks):
            if process.is_alive():
                tasks.put(None)
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self.processes = []


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    ranks = RankPool(tmp_path_factory.mktemp("store"))
    yield ranks
    ranks.close()


CASES = [(name, 1) for name in ARCHITECTURES] + [(name, 2) for name in ARCHITECTURES] + \
        [("llama-replicated", 4), ("gpt2", 4)]


@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{name}-tp{tp}" for name, tp in CASES])
def test_every_rank_computes_the_whole_model_s_logits_and_its_kv_heads_slice_of_the_cache(checkpoints, pool,
                                                                                           name, tp):
    path = checkpoints[name]
    model, config = load_model(path)
    want_logits, want_cache = run(model, config, config.num_kv_heads)
    if tp == 1:  # one rank is load_model itself, bit for bit, and needs no process group
        shard, _ = load_model_shard(path, rank=0, world_size=1)
        got_logits, got_cache = run(shard, config, num_kv_heads_per_rank(config, 1))
        assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got_cache.key_cache + got_cache.value_cache,
                                                     want_cache.key_cache + want_cache.value_cache, strict=True))
        ranks = [{"logits": got_logits, "key_cache": got_cache.key_cache, "value_cache": got_cache.value_cache}]
    else:
        ranks = pool.run(path, tp)
    for rank, got in enumerate(ranks):
        heads = list(kv_heads_of_rank(config, rank, tp))
        for step, (ours, want) in enumerate(zip(got["logits"], want_logits, strict=True)):
            where = f"rank {rank} of {tp}, step {step}, logits"
            torch.testing.assert_close(torch.as_tensor(ours), want, **tolerances.logits(config, CONTEXT, want),
                                       msg=lambda m, where=where: f"{where}: {m}")
        for layer in range(config.num_layers):
            for what in ("key_cache", "value_cache"):
                where = f"rank {rank} of {tp}, {what}[{layer}], KV heads {heads}"
                want = getattr(want_cache, what)[layer][:, :, heads]
                torch.testing.assert_close(torch.as_tensor(got[what][layer]), want,
                                           **tolerances.kv(config, CONTEXT, layer, want),
                                           msg=lambda m, where=where: f"{where}: {m}")


# ---------------------------------------------------------------------------------------------------
# Without processes: the rules, the shapes, the shards


def model_config(num_heads=4, num_kv_heads=2, intermediate_size=128, head_dim=16) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                       max_position_embeddings=64, norm_eps=1e-6)


@pytest.mark.parametrize(("config", "tp", "message"), [
    (model_config(num_heads=4), 3, r"num_heads \(4\) must be divisible by tensor_parallel_size \(3\)"),
    (model_config(intermediate_size=126), 4, r"intermediate_size \(126\) must be divisible"),
    (model_config(num_heads=12, num_kv_heads=3), 2, r"num_kv_heads \(3\) must be divisible by tensor_parallel_size"),
    (model_config(num_heads=12, num_kv_heads=3), 4, r"tensor_parallel_size \(4\) must be a multiple of num_kv_heads"),
    (model_config(), 0, "positive integer"),
])
def test_a_model_that_the_ranks_cannot_split_evenly_is_refused_saying_why(config, tp, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, tp)
    with pytest.raises(ValueError, match=message):
        shard_config(config, tp)


def test_the_loader_refuses_an_uneven_split_before_it_builds_or_reads_anything(checkpoints, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("nothing is built nor read before the split is checked")

    monkeypatch.setattr(parallel_module, "build_model_shard", fail)
    monkeypatch.setattr(parallel_module, "open_checkpoint", fail)
    with pytest.raises(ValueError, match="num_heads"):
        load_model_shard(checkpoints["llama-gqa"], rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank must be in 0 .. 1"):
        TensorParallelGroup(rank=2, world_size=2)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp", "expected"), [
    (4, 4, 2, [[0, 1], [2, 3]]),  # MHA: split
    (8, 4, 2, [[0, 1], [2, 3]]),  # GQA with at least as many KV heads as ranks: split
    (8, 2, 4, [[0], [0], [1], [1]]),  # fewer KV heads than ranks: each on tp // num_kv_heads = 2 ranks
    (8, 2, 8, [[0]] * 4 + [[1]] * 4),
    (8, 1, 4, [[0]] * 4),  # MQA: one KV head, everywhere
    (8, 2, 1, [[0, 1]]),
])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(num_heads, num_kv_heads, tp, expected):
    config = model_config(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64 // num_heads)
    assert [list(kv_heads_of_rank(config, rank, tp)) for rank in range(tp)] == expected
    assert num_kv_heads_per_rank(config, tp) == len(expected[0])
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    for rank in range(tp):
        queries = range(rank * num_heads // tp, (rank + 1) * num_heads // tp)
        assert {h // group for h in queries} <= set(expected[rank])
        qkv = QKVParallelLinear(64, 64 // num_heads, num_heads, num_kv_heads, False, TensorParallelGroup(rank, tp))
        _, rows, start = qkv.shard_rows("k")  # the rows the loader reads: those of the same heads
        assert (start // qkv.head_size, rows // qkv.head_size) == (expected[rank][0], len(expected[rank]))


def test_one_rank_s_layers_are_the_plain_layers_and_need_no_process_group():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    assert tensor_model_parallel_all_reduce(x) is x and tensor_model_parallel_all_gather(x) is x
    column, row = ColumnParallelLinear(8, 6), RowParallelLinear(8, 6)
    embed, head = VocabParallelEmbedding(VOCAB, 8), ParallelLMHead(VOCAB, 8)
    for layer in (column, row, embed):
        torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(row.bias)
    head.weight = embed.weight
    assert torch.equal(column(x), F.linear(x, column.weight, column.bias))
    assert torch.equal(row(x), F.linear(x, row.weight, row.bias))
    ids = torch.tensor([0, 5, VOCAB - 1])
    assert torch.equal(embed(ids), F.embedding(ids, embed.weight))
    assert torch.equal(head(x), F.linear(x, embed.weight)) and head(x).shape == (5, VOCAB)


def test_the_ranks_lookups_add_up_to_the_embedding_and_their_logits_join_into_the_lm_head_s(monkeypatch):
    """Each rank alone, its all-reduce and all-gather left out: its lookup is zeros outside its vocabulary
    slice, so the ranks' lookups add up to the whole embedding's; its logits are its slice's."""
    monkeypatch.setattr(parallel_module, "tensor_model_parallel_all_reduce", lambda x, tp=None: x)
    monkeypatch.setattr(parallel_module, "tensor_model_parallel_all_gather", lambda x, tp=None, dim=-1: x)
    torch.manual_seed(0)
    table, hidden = torch.randn(VOCAB, 8), torch.randn(3, 8)
    ids = torch.tensor([0, 24, 25, 74, 75, 96])
    lookups, logits = [], []
    for rank in range(4):  # rows 0-24, 25-49, 50-74, 75-96 (and 3 rows of padding)
        embed = VocabParallelEmbedding(VOCAB, 8, TensorParallelGroup(rank, 4))
        head = ParallelLMHead(VOCAB, 8, TensorParallelGroup(rank, 4))
        assert embed.weight.shape == (25, 8) and embed.vocab_start_index == 25 * rank
        rows = table[embed.vocab_start_index:embed.vocab_end_index]
        with torch.no_grad():
            embed.weight[: len(rows)] = rows
            head.weight[: len(rows)] = rows
        lookups.append(embed(ids))
        logits.append(head(hidden))
        inside = (ids >= embed.vocab_start_index) & (ids < embed.vocab_end_index)
        assert not lookups[-1][~inside].any()
    assert torch.equal(sum(lookups), F.embedding(ids, table))  # one non-zero term per row: exact
    torch.testing.assert_close(torch.cat(logits, -1)[:, :VOCAB], F.linear(hidden, table), rtol=0,
                               atol=tolerances.apart(tolerances.gamma(8)) * (hidden.abs() @ table.abs().T).max().item())


def shard_params(checkpoint, rank, tp):
    model, _ = load_model_shard(checkpoint, rank=rank, world_size=tp)
    return dict(model.named_parameters())


@pytest.mark.parametrize(("name", "tp"), [("llama-mha-bias", 2), ("llama-replicated", 4), ("qwen3", 2), ("gpt2", 4)])
def test_the_loader_gives_each_rank_its_rows_and_columns_of_the_checkpoint(checkpoints, name, tp):
    whole, config = load_model(checkpoints[name])
    full = dict(whole.named_parameters())
    d, local = config.head_dim, shard_config(config, tp)
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    per_vocab = -(-VOCAB // tp)
    for rank in range(tp):
        params = shard_params(checkpoints[name], rank, tp)
        assert sorted(params) == sorted(full)  # the same names: the shard is the same model, in slices
        heads = kv_heads_of_rank(config, rank, tp)
        kv_slice = slice(heads.start * d, heads.stop * d)
        q_slice = slice(rank * q_rows // tp, (rank + 1) * q_rows // tp)
        i_slice = slice(rank * config.intermediate_size // tp, (rank + 1) * config.intermediate_size // tp)
        embed = "transformer.wte.weight" if name == "gpt2" else "model.embed_tokens.weight"
        vocab = slice(rank * per_vocab, min((rank + 1) * per_vocab, VOCAB))
        expected_embed = torch.zeros(per_vocab, config.hidden_size)
        expected_embed[: vocab.stop - vocab.start] = full[embed][vocab]
        assert torch.equal(params[embed], expected_embed)  # the rank's rows, then zero padding
        for layer in range(config.num_layers):
            if name == "gpt2":
                p = f"transformer.h.{layer}."
                qkv = full[p + "attn.c_attn.weight"].t()  # Conv1D: (in, out) in the checkpoint and in load_model
                q, k, v = qkv.split(config.hidden_size)
                expected = {"attn.c_attn.weight": torch.cat([q[q_slice], k[kv_slice], v[kv_slice]]),
                            "attn.c_proj.weight": full[p + "attn.c_proj.weight"].t()[:, q_slice],
                            "attn.c_proj.bias": full[p + "attn.c_proj.bias"],  # whole: added once, after the reduce
                            "mlp.c_fc.weight": full[p + "mlp.c_fc.weight"].t()[i_slice],
                            "mlp.c_proj.weight": full[p + "mlp.c_proj.weight"].t()[:, i_slice]}
            else:
                p = f"model.layers.{layer}."
                q, k, v = full[p + "self_attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
                gate, up = full[p + "mlp.gate_up_proj.weight"].chunk(2)
                expected = {"self_attn.qkv_proj.weight": torch.cat([q[q_slice], k[kv_slice], v[kv_slice]]),
                            "self_attn.o_proj.weight": full[p + "self_attn.o_proj.weight"][:, q_slice],
                            "mlp.gate_up_proj.weight": torch.cat([gate[i_slice], up[i_slice]]),
                            "mlp.down_proj.weight": full[p + "mlp.down_proj.weight"][:, i_slice]}
                if config.qkv_bias:
                    q, k, v = full[p + "self_attn.qkv_proj.bias"].split([q_rows, kv_rows, kv_rows])
                    expected["self_attn.qkv_proj.bias"] = torch.cat([q[q_slice], k[kv_slice], v[kv_slice]])
                if config.o_bias:
                    expected["self_attn.o_proj.bias"] = full[p + "self_attn.o_proj.bias"]  # whole
                if config.qk_norm:
                    expected["self_attn.q_norm.weight"] = full[p + "self_attn.q_norm.weight"]
                if config.mlp_bias:
                    expected["mlp.down_proj.bias"] = full[p + "mlp.down_proj.bias"]
            for key, value in expected.items():
                assert torch.equal(params[p + key], value), f"rank {rank} of {tp}: {p + key}"
        attention = "attn.c_attn" if name == "gpt2" else "self_attn.qkv_proj"
        assert params[f"{p}{attention}.weight"].shape == (
            (local.num_heads + 2 * local.num_kv_heads) * d, config.hidden_size)


def test_a_rank_reads_only_its_part_of_each_split_weight(checkpoints, monkeypatch):
    """From safetensors, through get_slice: a split weight is never read whole by one rank."""
    reads: dict[str, list[tuple]] = {}

    class RecordingSlice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            part = self.inner[index]
            reads.setdefault(self.name, []).append(tuple(part.shape))
            return part

    real = parallel_module.safe_open

    class RecordingFile:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return RecordingSlice(name, self.file.get_slice(name))

    monkeypatch.setattr(parallel_module, "safe_open", RecordingFile)
    load_model_shard(checkpoints["llama-replicated"], rank=3, world_size=4)
    split = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
             "up_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")
    from safetensors import safe_open

    with safe_open(str(Path(checkpoints["llama-replicated"]) / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert set(reads) == set(shapes)
    for name, parts in reads.items():
        read = sum(torch.Size(s).numel() for s in parts)
        if name.endswith(split):
            assert read * 2 <= torch.Size(shapes[name]).numel(), f"{name}: {parts} of {shapes[name]}"
        else:
            assert parts == [shapes[name]], name  # norms: whole, once


def test_a_bin_checkpoint_loads_the_same_shards_as_safetensors(checkpoints, tmp_path):
    source = Path(checkpoints["qwen2"])
    shutil.copy(source / "config.json", tmp_path / "config.json")
    whole, _ = load_model(source)
    from safetensors.torch import load_file

    torch.save(load_file(source / "model.safetensors"), tmp_path / "pytorch_model.bin")
    assert all(torch.equal(a, b) for a, b in zip(load_model(tmp_path)[0].state_dict().values(),
                                                 whole.state_dict().values(), strict=True))
    for rank in range(2):
        from_bin, from_safetensors = shard_params(tmp_path, rank, 2), shard_params(source, rank, 2)
        assert sorted(from_bin) == sorted(from_safetensors)
        assert all(torch.equal(from_bin[k], from_safetensors[k]) for k in from_bin)


def test_a_rank_s_kv_cache_is_sized_by_its_kv_heads(checkpoints):
    config = load_config(checkpoints["llama-replicated"])  # 8 query heads, 2 KV heads
    assert [num_kv_heads_per_rank(config, tp) for tp in (1, 2, 4)] == [2, 1, 1]
    local = shard_config(config, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 32, 25)
    assert local.kv_bytes_per_token(torch.float32) * 2 == config.kv_bytes_per_token(torch.float32)
