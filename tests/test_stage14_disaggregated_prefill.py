"""Stage 14: disaggregated prefill. A producer and a consumer over one folder of blocks generate what one
engine generates, token for token; the consumer computes only each prompt's last block; a block that
cannot be loaded is recomputed, with the same output, and counted."""

import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch
from test_stage10_v1_scheduler import one_thread  # noqa: F401 (one_thread: an autouse fixture)

from minipaged import LLM, SamplingParams
from minipaged.models import load_config, resolve_model_path
from minipaged.stage9_prefix_caching import ROOT, block_hash
from minipaged.stage14_kv_connector import block_path, prompt_block_hashes, read_block, write_block

pytestmark = pytest.mark.stage14

BLOCK = 4
SIZES = dict(num_gpu_blocks=256, max_model_len=256, block_size=BLOCK)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # what the proxy asks a producer


def ids(tokens):
    return {"prompt_token_ids": list(tokens)}


def hundred_prompts():
    """1 to 11 blocks of 4, full and partial last blocks, and prompts that share 1 to 3 prefixes."""
    rng = random.Random(14)
    prefixes = [[rng.randrange(1, 2048) for _ in range(n)] for n in (4, 8, 13)]
    prompts = []
    for i in range(100):
        head = prefixes[i % 3] if i % 2 else []
        prompts.append(ids(head + [rng.randrange(1, 2048) for _ in range(rng.randint(1, 44 - len(head)))]))
    return prompts


def role(folder, kv_role, **kwargs):
    config = {"kv_role": kv_role, "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    return LLM("tiny", kv_transfer_config=config, **{**SIZES, **kwargs})


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def disaggregated(folder, prompts, producer_args=None, consumer_args=None, params=GREEDY):
    """The proxy's two requests, in process: the prompt to the producer (1 token), then all of it to the consumer."""
    tokens(role(folder, "kv_producer", **(producer_args or {})), prompts, PREFILL)
    consumer = role(folder, "kv_consumer", **(consumer_args or {}))
    return tokens(consumer, prompts, params), consumer


def loadable_tokens(prompt):
    return (len(prompt["prompt_token_ids"]) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def single_engine_100():
    return tokens(LLM("tiny", **SIZES), hundred_prompts())


def test_producer_and_consumer_equal_one_engine_on_100_prompts(tmp_path, single_engine_100):
    got, consumer = disaggregated(tmp_path, hundred_prompts())
    assert got == single_engine_100
    assert consumer.stats.kv_transfer.num_loaded_blocks > 0


def test_the_consumer_computes_only_each_prompts_last_block(tmp_path):
    prompts = hundred_prompts()[:30]
    _, consumer = disaggregated(tmp_path, prompts, consumer_args={"enable_prefix_caching": False})
    stats = consumer.stats
    loadable = sum(loadable_tokens(p) for p in prompts)
    assert stats.kv_transfer.num_external_tokens == loadable
    assert stats.prefill_tokens == sum(len(p["prompt_token_ids"]) for p in prompts) - loadable
    assert stats.kv_transfer.num_recomputed_tokens == stats.kv_transfer.num_failed_blocks == 0


def test_a_prompts_blocks_are_named_by_the_prefix_caches_chain_up_to_its_last_tokens_block():
    for n in (1, 3, 4, 5, 8, 9, 13):
        prompt = list(range(100, 100 + n))
        chain, digest = [], ROOT
        for start in range(0, (n - 1) // BLOCK * BLOCK, BLOCK):
            digest = block_hash(digest, prompt[start:start + BLOCK])
            chain.append(digest)
        assert prompt_block_hashes(prompt, BLOCK) == chain
        assert len(chain) == (n - 1) // BLOCK  # 8 tokens: 1 block (the second holds the last token)


def test_a_block_shared_only_after_a_different_first_block_is_never_loaded(tmp_path):
    tail = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    first, second = ids([5, 6, 7, 8] + tail), ids([9, 10, 11, 12] + tail)
    tokens(role(tmp_path, "kv_producer"), [first], PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    assert tokens(consumer, [second]) == tokens(LLM("tiny", **SIZES), [second])
    assert consumer.stats.kv_transfer.num_external_tokens == 0


def test_the_consumer_takes_the_blocks_up_to_the_first_missing_file(tmp_path):
    prompt = ids(range(200, 217))  # 4 loadable blocks
    tokens(role(tmp_path, "kv_producer"), [prompt], PREFILL)
    block_path(tmp_path, prompt_block_hashes(prompt["prompt_token_ids"], BLOCK)[2]).unlink()
    consumer = role(tmp_path, "kv_consumer")
    assert tokens(consumer, [prompt]) == tokens(LLM("tiny", **SIZES), [prompt])
    assert consumer.stats.kv_transfer.num_external_tokens == 2 * BLOCK
    assert consumer.stats.prefill_tokens == 17 - 2 * BLOCK


def spoil(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[-3] ^= 0xFF  # a byte of the K/V: the header still reads
        path.write_bytes(bytes(data))
    elif how == "short":
        path.write_bytes(bytes(data[:len(data) // 2]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "other-shape":  # another model's block: a sound file of another shape
        write_block(path, torch.zeros(1, 2, BLOCK, 1, 1))
    elif how in ("other-model", "other-block"):  # sound files of this shape: another model's, another block's
        kv = safetensors.torch.load(bytes(data))["kv"]
        digest = bytes.fromhex(path.stem)
        if how == "other-model":  # the same K/V written for other weights of the same shapes
            write_block(path, kv, digest, "another model")
        else:  # the next block's file (its K/V, its name) copied under this block's name
            shutil.copyfile(next(p for p in path.parent.glob("*.safetensors") if p != path), path)
    elif how == "fifo":  # opening it to read would wait for a writer, forever
        path.unlink()
        os.mkfifo(path)
    else:  # a folder where the file was
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize("how", ["corrupt", "short", "empty", "other-shape", "other-model", "other-block", "fifo",
                                 "folder"])
def test_a_block_that_cannot_be_loaded_is_recomputed_with_the_same_output(tmp_path, how):
    prompts = [ids(range(300, 318)), ids(range(400, 410))]
    tokens(role(tmp_path, "kv_producer"), prompts, PREFILL)
    spoil(block_path(tmp_path, prompt_block_hashes(prompts[0]["prompt_token_ids"], BLOCK)[1]), how)
    consumer = role(tmp_path, "kv_consumer", enable_prefix_caching=False)
    signal.alarm(60)  # a consumer that waits on a FIFO fails here instead of hanging
    try:
        assert tokens(consumer, prompts) == tokens(LLM("tiny", **SIZES), prompts)
    finally:
        signal.alarm(0)
    stats = consumer.stats
    assert stats.kv_transfer.num_failed_blocks == 1
    assert stats.kv_transfer.num_recomputed_tokens == loadable_tokens(prompts[0])  # all it had been given
    # the first attempt's last block, then the whole prompt again, and the other prompt's last block
    assert stats.prefill_tokens == (18 - 16) + 18 + (10 - 8)
    assert consumer.scheduler.block_manager.num_free_blocks == SIZES["num_gpu_blocks"]
    manager = consumer.scheduler.kv_cache_manager  # nothing of a finished request is kept
    assert not (manager.external or manager.without_connector or manager.connector.hashes
                or manager.connector.block_ids)


def test_a_damaged_file_is_replaced_whole_by_the_next_save_of_its_block(tmp_path):
    prompt = ids(range(330, 343))
    tokens(role(tmp_path, "kv_producer"), [prompt], PREFILL)
    path = block_path(tmp_path, prompt_block_hashes(prompt["prompt_token_ids"], BLOCK)[0])
    spoil(path, "corrupt")
    tokens(role(tmp_path, "kv_producer"), [prompt], PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    assert tokens(consumer, [prompt]) == tokens(LLM("tiny", **SIZES), [prompt])
    assert consumer.stats.kv_transfer.num_failed_blocks == 0
    assert consumer.stats.kv_transfer.num_external_tokens == loadable_tokens(prompt)


def test_a_file_gone_between_scheduling_and_loading_is_recomputed(tmp_path):
    """The scheduler side saw the files; they are gone when the worker side loads: never read as K/V."""
    prompts = [ids(range(500, 513)), ids(range(600, 607))]
    tokens(role(tmp_path, "kv_producer"), prompts, PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    connector = consumer.scheduler.kv_cache_manager.connector
    build = connector.build_connector_meta

    def build_then_remove_the_store(out):
        meta = build(out)
        shutil.rmtree(tmp_path, ignore_errors=True)
        return meta
    connector.build_connector_meta = build_then_remove_the_store
    assert tokens(consumer, prompts) == tokens(LLM("tiny", **SIZES), prompts)
    assert consumer.stats.kv_transfer.num_recomputed_tokens == 12 + 4


def test_the_store_removed_while_serving_leaves_both_engines_serving(tmp_path):
    prompts = hundred_prompts()[:12]
    expected = tokens(LLM("tiny", **SIZES), prompts)
    producer, consumer = role(tmp_path, "kv_producer"), role(tmp_path, "kv_consumer")
    tokens(producer, prompts[:6], PREFILL)
    assert tokens(consumer, prompts[:6]) == expected[:6]
    shutil.rmtree(tmp_path)
    tokens(producer, prompts[6:], PREFILL)  # the folder comes back with the blocks saved from now on
    loaded = consumer.stats.kv_transfer.num_loaded_blocks
    assert tokens(consumer, prompts[6:]) == expected[6:]
    assert consumer.stats.kv_transfer.num_loaded_blocks > loaded  # from the folder made again
    assert any(tmp_path.iterdir())
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".safetensors"] * len(list(tmp_path.iterdir()))


def test_a_producer_saves_a_block_only_after_the_step_that_computes_it(tmp_path):
    """Chunked prefill on the producer (3 tokens a step): a block is saved in the step that writes its last token."""
    prompts = [ids(range(700, 723)), ids(range(800, 810))]
    got, _ = disaggregated(tmp_path, prompts, producer_args={"max_num_batched_tokens": 3})
    assert got == tokens(LLM("tiny", **SIZES), prompts)


def test_a_producer_step_cut_short_leaves_nothing_half_saved(tmp_path):
    """An interrupt after two layers handed their blocks over: the next step saves its own blocks only."""
    first, second = ids(range(1200, 1209)), ids(range(1300, 1317))
    producer = role(tmp_path, "kv_producer")
    connector = producer.engine.runner.kv_connector.connector
    save = connector.save_kv_layer

    def save_then_interrupt(layer, kv_layer, attn_metadata):
        save(layer, kv_layer, attn_metadata)
        if layer == 1:
            connector.save_kv_layer = save
            raise KeyboardInterrupt
    connector.save_kv_layer = save_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        tokens(producer, [first], PREFILL)
    tokens(producer, [second], PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    assert tokens(consumer, [second]) == tokens(LLM("tiny", **SIZES), [second])
    assert consumer.stats.kv_transfer.num_loaded_blocks == loadable_tokens(second) // BLOCK
    assert consumer.stats.kv_transfer.num_failed_blocks == 0


def test_blocks_no_layer_handed_over_are_gathered_after_the_forward(tmp_path):
    """A decode step replayed from a CUDA graph runs no Python in its layers: the saves still happen."""
    prompts = [ids(range(1400, 1413))]
    producer = role(tmp_path, "kv_producer")
    producer.engine.runner.backend = producer.engine.runner.backend.backend  # the layers call no connector
    tokens(producer, prompts, PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    assert tokens(consumer, prompts) == tokens(LLM("tiny", **SIZES), prompts)
    assert consumer.stats.kv_transfer.num_loaded_blocks == 3


def test_kv_both_never_saves_a_block_it_failed_to_load_nor_what_it_computed_on_it(tmp_path):
    """A kv_both engine whose load fails computes that step on K/V that are not there: it saves nothing of
    that request then (neither the block that failed nor the blocks computed after it), and saves its
    blocks once recomputed; a later consumer loads them all and equals one engine."""
    short, prompt = ids(range(700, 709)), ids(list(range(700, 708)) + list(range(800, 809)))  # 2 blocks shared
    tokens(role(tmp_path, "kv_producer"), [short], PREFILL)  # saves 2 blocks
    hashes = prompt_block_hashes(prompt["prompt_token_ids"], BLOCK)  # 4 blocks travel
    spoil(block_path(tmp_path, hashes[1]), "corrupt")
    both = role(tmp_path, "kv_both")
    both.engine.add_request("r", prompt, GREEDY)
    both.engine.step()  # loads block 0, fails block 1, and computes blocks 2 and 3 on them
    assert both.stats.kv_transfer.num_failed_blocks == 1
    shape, model = (4, 2, BLOCK, 2, 32), model_of(both)
    assert read_block(block_path(tmp_path, hashes[1]), shape, torch.float32, hashes[1], model) is None  # as it was
    assert not any(block_path(tmp_path, digest).exists() for digest in hashes[2:])
    while both.engine.has_unfinished_requests():  # recomputed, and saved then
        both.engine.step()
    expected = tokens(LLM("tiny", **SIZES), [prompt])
    consumer = role(tmp_path, "kv_consumer")
    assert tokens(consumer, [prompt]) == expected
    stats = consumer.stats.kv_transfer
    assert stats.num_failed_blocks == 0 and stats.num_loaded_blocks == len(hashes)


def model_of(llm):
    """The identity of the weights an engine's connector reads and writes K/V for."""
    return llm.engine.runner.kv_connector.connector.model


def test_the_bytes_moved_are_layers_x_2_x_tokens_x_kv_heads_x_head_dim_x_dtype_bytes(tmp_path):
    prompts = [ids(range(900, 921))]
    mc = load_config(resolve_model_path("tiny"))
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        folder = tmp_path / dtype
        _, consumer = disaggregated(folder, prompts, {"dtype": dtype}, {"dtype": dtype}, PREFILL)
        moved = mc.num_layers * 2 * loadable_tokens(prompts[0]) * mc.num_kv_heads * mc.head_dim * size
        assert consumer.stats.kv_transfer.num_loaded_bytes == moved
        path = next(folder.iterdir())
        block = read_block(path, (mc.num_layers, 2, BLOCK, mc.num_kv_heads, mc.head_dim),
                           consumer.cache.key_cache[0].dtype, bytes.fromhex(path.stem), model_of(consumer))
        assert block is not None and block.numel() * block.element_size() == moved // 5


def test_the_loaded_blocks_hold_the_producers_k_and_v(tmp_path):
    prompt = ids(range(1000, 1013))
    producer = role(tmp_path, "kv_producer")
    tokens(producer, [prompt], PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    request = consumer.engine.add_request("r", prompt, GREEDY)
    consumer.engine.step()
    table = consumer.scheduler.block_manager.get_block_table(request.seqs[0].seq_id)
    for i, digest in enumerate(prompt_block_hashes(prompt["prompt_token_ids"], BLOCK)):
        kv = read_block(block_path(tmp_path, digest), (4, 2, BLOCK, 2, 32), torch.float32, digest, model_of(consumer))
        for layer in range(4):
            assert torch.equal(consumer.cache.key_cache[layer][table[i]], kv[layer, 0])
            assert torch.equal(consumer.cache.value_cache[layer][table[i]], kv[layer, 1])


def test_kv_both_loads_what_is_stored_and_saves_what_it_computes(tmp_path):
    prompts = hundred_prompts()[:10]
    first = role(tmp_path, "kv_both")
    assert tokens(first, prompts) == tokens(LLM("tiny", **SIZES), prompts)
    assert first.stats.kv_transfer.num_saved_blocks > 0
    second = role(tmp_path, "kv_both", enable_prefix_caching=False)
    assert tokens(second, prompts) == tokens(LLM("tiny", **SIZES), prompts)
    assert second.stats.kv_transfer.num_external_tokens == sum(loadable_tokens(p) for p in prompts)


def test_a_producer_saves_each_block_once_however_many_steps_its_request_runs(tmp_path):
    prompt = ids(range(1200, 1217))  # 4 blocks travel
    producer = role(tmp_path, "kv_producer")
    tokens(producer, [prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))  # 9 steps
    assert producer.stats.kv_transfer.num_saved_blocks == 4


def test_a_producer_saves_the_blocks_of_a_request_that_asks_for_prompt_logprobs(tmp_path):
    """Such a request asks the connector for nothing (it reads no cached K/V); the connector still hears of
    its blocks, and saves them."""
    prompt = ids(range(1300, 1313))  # 3 blocks travel
    producer = role(tmp_path, "kv_producer")
    producer.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert producer.stats.kv_transfer.num_saved_blocks == 3


def test_a_local_prefix_hit_is_not_counted_as_the_connectors_tokens(tmp_path):
    """A prompt's first 2 blocks found in the consumer's own prefix cache (a shorter prompt loaded them), its
    next 2 from the store: the connector supplied 8 tokens to it, not 16."""
    prompt = ids(range(1400, 1417))  # 4 blocks travel
    tokens(role(tmp_path, "kv_producer"), [prompt], PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    tokens(consumer, [ids(prompt["prompt_token_ids"][:9])])  # loads the first 2 blocks
    assert consumer.stats.kv_transfer.num_external_tokens == 2 * BLOCK
    tokens(consumer, [prompt])
    stats = consumer.stats
    assert stats.kv_transfer.num_external_tokens == 4 * BLOCK and stats.prefix_cache_hits >= 2


def test_a_request_asking_for_prompt_logprobs_loads_nothing(tmp_path):
    prompt = ids(range(1100, 1114))
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    tokens(role(tmp_path, "kv_producer"), [prompt], PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    got = consumer.generate([prompt], params, use_tqdm=False)[0]
    want = LLM("tiny", **SIZES).generate([prompt], params, use_tqdm=False)[0]
    assert consumer.stats.kv_transfer.num_external_tokens == 0
    assert [None if p is None else sorted(p) for p in got.prompt_logprobs] == \
        [None if p is None else sorted(p) for p in want.prompt_logprobs]
    assert got.prompt_logprobs == want.prompt_logprobs  # the values too: every position computed here


def test_a_consumer_under_memory_pressure_equals_one_engine(tmp_path):
    prompts = hundred_prompts()[:16]
    tight = {"num_gpu_blocks": 24, "max_model_len": 96}
    got, consumer = disaggregated(tmp_path, prompts, consumer_args=tight)
    assert got == tokens(LLM("tiny", **{**SIZES, **tight}), prompts)
    assert consumer.stats.num_preemptions > 0


def test_an_fp8_consumer_equals_one_fp8_engine(tmp_path):
    prompts = hundred_prompts()[:10]
    fp8 = {"kv_cache_dtype": "fp8"}
    got, consumer = disaggregated(tmp_path, prompts, fp8, fp8)
    assert got == tokens(LLM("tiny", **SIZES, **fp8), prompts)
    stats = consumer.stats.kv_transfer  # loaded, not recomputed
    assert stats.num_loaded_blocks == sum(loadable_tokens(p) for p in prompts) // BLOCK
    assert stats.num_failed_blocks == stats.num_recomputed_tokens == 0


def test_an_exception_inside_a_step_leaves_the_consumer_usable_with_every_block_back(tmp_path):
    prompts = hundred_prompts()[:4]
    tokens(role(tmp_path, "kv_producer"), prompts, PREFILL)
    consumer = role(tmp_path, "kv_consumer")
    connector = consumer.engine.runner.kv_connector.connector
    load = connector.start_load_kv

    def interrupted():
        raise KeyboardInterrupt
    connector.start_load_kv = interrupted
    with pytest.raises(KeyboardInterrupt):
        consumer.generate(prompts, GREEDY, use_tqdm=False)
    assert consumer.scheduler.block_manager.num_free_blocks == SIZES["num_gpu_blocks"]
    assert connector.metadata is None
    connector.start_load_kv = load
    assert tokens(consumer, prompts) == tokens(LLM("tiny", **SIZES), prompts)


# -- under tensor parallelism: every worker moves its shard of the KV heads ----------------------------------------

TP_SETS = {"loaded": [ids(range(1100, 1118)), ids(range(1200, 1213))],  # 4 and 3 loadable blocks
           "damaged": [ids(range(1300, 1318))],  # its second block's file spoiled on rank 1
           "partial": [ids(range(1400, 1421))],  # its third block's file gone from rank 1
           "mixed": [ids(range(1500, 1518))]}  # its second block spoiled on rank 1, its third and fourth gone


@pytest.fixture(scope="module")
def tp2_store(tmp_path_factory):
    """A folder a producer of 2 ranks saved every set's prompts to, and one engine's tokens for each set."""
    folder = tmp_path_factory.mktemp("tp2-store")
    with role(folder, "kv_producer", tensor_parallel_size=2) as producer:
        tokens(producer, [p for prompts in TP_SETS.values() for p in prompts], PREFILL)
        assert producer.stats.kv_transfer.num_saved_blocks == 4 + 3 + 4 + 5 + 4
    single = LLM("tiny", **SIZES)
    return folder, {name: tokens(single, prompts) for name, prompts in TP_SETS.items()}


def rank_file(folder, rank, prompt, block):
    return block_path(folder / f"tp2_rank{rank}", prompt_block_hashes(prompt["prompt_token_ids"], BLOCK)[block])


@pytest.mark.rounding_free
def test_each_rank_of_a_tensor_parallel_producer_saves_its_shard_in_its_own_folder(tp2_store):
    folder, _ = tp2_store
    names = [{p.name for p in (folder / f"tp2_rank{rank}").iterdir()} for rank in range(2)]
    assert names[0] == names[1] and len(names[0]) == 4 + 3 + 4 + 5 + 4
    assert not list(folder.glob("*.safetensors"))  # nothing where a single process looks
    mc = load_config(resolve_model_path("tiny"))
    kv = safetensors.torch.load_file(rank_file(folder, 1, TP_SETS["loaded"][0], 0))["kv"]
    assert tuple(kv.shape) == (mc.num_layers, 2, BLOCK, mc.num_kv_heads // 2, mc.head_dim)  # rank 1's KV heads


@pytest.mark.rounding_free
def test_a_single_process_consumer_reads_no_tensor_parallel_rank_files(tp2_store):
    folder, expected = tp2_store
    consumer = role(folder, "kv_consumer")
    assert tokens(consumer, TP_SETS["loaded"]) == expected["loaded"]
    stats = consumer.stats.kv_transfer
    assert stats.num_external_tokens == stats.num_loaded_blocks == stats.num_failed_blocks == 0


@pytest.mark.rounding_free
def test_a_tensor_parallel_consumer_loads_every_ranks_shard_and_equals_one_engine(tp2_store):
    """A consumer of 2 ranks (kv_both) loads each rank's shard of the blocks; a block spoiled on one rank
    fails on both, its request is recomputed (and its files saved again); a block missing on one rank
    is not counted, nor any after it."""
    from minipaged.stage14_disaggregated_prefill import TensorParallelKVConnector

    folder, expected = tp2_store
    mc = load_config(resolve_model_path("tiny"))
    spoiled, gone = rank_file(folder, 1, TP_SETS["damaged"][0], 1), rank_file(folder, 1, TP_SETS["partial"][0], 2)
    spoiled.write_bytes(b"not a block")
    gone.unlink()
    with role(folder, "kv_both", tensor_parallel_size=2) as consumer:
        assert isinstance(consumer.engine.runner.kv_connector, TensorParallelKVConnector)
        assert tokens(consumer, TP_SETS["loaded"]) == expected["loaded"]
        stats = consumer.stats.kv_transfer
        assert (stats.num_loaded_blocks, stats.num_failed_blocks, stats.num_saved_blocks) == (4 + 3, 0, 0)
        assert stats.num_external_tokens == (4 + 3) * BLOCK
        block_bytes = mc.num_layers * 2 * BLOCK * mc.num_kv_heads * mc.head_dim * consumer.dtype.itemsize
        assert stats.num_loaded_bytes == (4 + 3) * block_bytes  # both ranks' halves of the heads

        assert tokens(consumer, TP_SETS["damaged"]) == expected["damaged"]
        stats = consumer.stats.kv_transfer
        assert stats.num_failed_blocks == 1 and stats.num_loaded_blocks == 4 + 3 + 3  # not rank 0's good read of it
        assert stats.num_recomputed_tokens == loadable_tokens(TP_SETS["damaged"][0])
        assert stats.num_saved_blocks == 4 and spoiled.read_bytes() != b"not a block"  # saved again, whole

        assert tokens(consumer, TP_SETS["partial"]) == expected["partial"]
        after = consumer.stats.kv_transfer
        assert after.num_external_tokens - stats.num_external_tokens == 2 * BLOCK  # up to rank 1's gap
        assert after.num_failed_blocks == 1 and gone.exists()  # computed, and saved by both ranks

        # a step that loads a block spoiled on rank 1 and computes blocks after it: neither rank saves them
        prompt = TP_SETS["mixed"][0]
        for block in (2, 3):
            for rank in range(2):
                rank_file(folder, rank, prompt, block).unlink()
        rank_file(folder, 1, prompt, 1).write_bytes(b"not a block")
        consumer.engine.add_request("mixed", prompt, GREEDY)
        consumer.engine.step()  # loads blocks 0 and 1 (1 fails on rank 1 only), computes 2 and 3
        assert consumer.stats.kv_transfer.num_failed_blocks == 2
        assert not [(r, b) for r in range(2) for b in (2, 3) if rank_file(folder, r, prompt, b).exists()]
        outputs = []
        while consumer.engine.has_unfinished_requests():
            outputs += consumer.engine.step()
        assert [o.outputs[0].token_ids for o in outputs if o.finished] == expected["mixed"]
        assert all(rank_file(folder, r, prompt, b).exists() for r in range(2) for b in (1, 2, 3))  # recomputed
        assert consumer.scheduler.block_manager.num_free_blocks == SIZES["num_gpu_blocks"]
        counted = consumer.stats.kv_transfer
    assert consumer.stats.kv_transfer == counted  # the counts came back with the steps: readable once closed
