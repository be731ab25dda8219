"""The numbers in the stage pages' self-checks, computed by minipaged itself.

Every stage page ends with questions whose answers are folded (``??? question "…"``).
Where an answer is a number (or a name the code decides, such as a preemption victim),
it is written in bold, and this file computes it with the project's public API: the
bold spans of the answer must be exactly what the code gives, in order. A page that
drifts from the code, or code that changes what the page promised, fails here. A
translated page (``N_topic.zh.md``) that carries the self-check is held to the same
numbers. The worked examples in the pages' text (stage 2's memory table, the shared system
prompts of stages 3 and 9, stage 8's sampling table, the home page's figure, the KV size of
OPT-13B in the references) are computed here too.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from minipaged import (
    BlockAllocator,
    BlockSpaceManager,
    ContiguousKVCache,
    CowBlockSpaceManager,
    OutOfBlocksError,
    PagedKVCache,
    PrefixCachingAllocator,
    PrefixCachingBlockSpaceManager,
    RefCountedBlockAllocator,
    SamplingParams,
    Scheduler,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    SwapBlockSpaceManager,
    paged_attention_ref,
)
from minipaged.perf.simulate import simulate_contiguous, simulate_paged, synthetic_requests
from minipaged.stage5_triton_attention import PARTITION_SIZE

pytestmark = pytest.mark.tooling

STAGES = Path(__file__).resolve().parent.parent / "docs" / "stages"
PAGES = {n: next(p for p in sorted(STAGES.glob(f"{n}_*.md")) if not p.name.endswith(".zh.md"))
         for n in range(10)}
QUESTION = re.compile(r'^\?\?\?\+? question "(?P<title>.*)"\s*$')
BOLD = re.compile(r"\*\*(.+?)\*\*")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is several times faster than two on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def answers(page: Path) -> list[tuple[str, str]]:
    """The page's self-check: (question, folded answer) in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        match = QUESTION.match(line)
        if match:
            body = []
            for following in lines[i + 1:]:
                if following.strip() and not following.startswith("    "):
                    break
                body.append(following)
            found.append((match["title"], "\n".join(body)))
    return found


def normal(text: str) -> str:
    """Compare numbers as written: 819,200 and 819 200 and 819200 are the same."""
    return re.sub(r"[\s,\u202f\u2009]", "", str(text))


def bold_spans(page: Path, index: int) -> list[str]:
    found = answers(page)
    assert index < len(found), f"{page.name} has {len(found)} self-check questions, not {index + 1}"
    return [normal(b) for b in BOLD.findall(found[index][1])]


def check(stage: int, index: int, *expected) -> None:
    """Question ``index`` of the stage's page (and of its translation) answers ``expected``."""
    page = PAGES[stage]
    want = [normal(e) for e in expected]
    assert bold_spans(page, index) == want, f"{page.name}, question {index + 1}: {answers(page)[index][0]}"
    translated = page.with_name(page.name.replace(".md", ".zh.md"))
    if translated.exists() and len(answers(translated)) == len(answers(page)):
        want = [IN_CHINESE.get(w, w) for w in want]
        assert bold_spans(translated, index) == want, f"{translated.name}, question {index + 1}"


def check_both(page: Path, index: int, *expected) -> None:
    """Question ``index`` of a stage's page and of its translation (the same numbers) answers ``expected``."""
    want = [normal(e) for e in expected]
    for each in (page, page.with_name(page.name.replace(".md", ".zh.md"))):
        assert bold_spans(each, index) == want, f"{each.name}, question {index + 1}: {answers(each)[index][0]}"


IN_CHINESE = {"no": "不能", "yes": "能", "recomputed": "重算"}  # a word answer, as the Chinese pages say it


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token slot holds, measured on a real one-slot paged cache."""
    cache = PagedKVCache(num_layers, 1, 1, num_kv_heads, head_dim, dtype)
    return sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache)


def kib(num_bytes: int) -> str:
    assert num_bytes % 1024 == 0
    return f"{num_bytes // 1024:,}"


# Questions answered in words: their answers hold no bold, so that every bold answer is one
# that a test below computes.
IN_WORDS = {0: {5}, 1: {4}, 2: {4}, 3: {4}, 4: {2, 3}, 5: {2, 4}, 6: set(), 7: {4}, 8: {1, 2, 3}, 9: {4}}


def test_every_stage_page_ends_with_a_self_check_and_an_interview_answer():
    for stage, page in PAGES.items():
        text = page.read_text(encoding="utf-8")
        assert 4 <= len(answers(page)) <= 6, f"{page.name}: 4 to 6 self-check questions"
        assert "## Self-check" in text and "## Explain it in an interview" in text, page.name
        assert text.index("## Self-check") < text.index("## Explain it in an interview"), page.name
        for index, (title, body) in enumerate(answers(page)):
            assert title.strip() and body.strip(), f"{page.name}: {title!r} has no answer"
            if index in IN_WORDS[stage]:
                assert not bold_spans(page, index), f"{page.name}: {title!r} is answered in words"
            else:
                assert bold_spans(page, index), f"{page.name}: {title!r} has no computed answer"


# The interview section opens with the answer in brief, short enough to say in about twenty
# seconds: at most two sentences, of at most 60 words, or in Chinese 90 spoken units (a
# character, or a word or number in Latin letters, such as `block_size` or 2,048).
IN_SHORT = {"en": ("## Explain it in an interview", "**In short:**", 60),
            "zh": ("{#explain-it-in-an-interview}", "**简短版：**", 90)}


def in_short(page: Path) -> tuple[str, list[str], int]:
    """The page's answer in brief: its text, its sentences, and how many words (spoken units) it has."""
    heading, label, _ = IN_SHORT["zh" if page.name.endswith(".zh.md") else "en"]
    text = page.read_text(encoding="utf-8")
    assert text.count(heading) == 1, f"{page.name}: one interview section"
    section = text[text.index("\n", text.index(heading)):].lstrip("\n")
    first = section[:section.find("\n\n")] if "\n\n" in section else section
    assert first.startswith(label), f"{page.name}: its interview section opens with {label}"
    brief = " ".join(first[len(label):].split())
    if label == "**In short:**":
        return brief, re.findall(r".+?[.!?](?=\s|$)", brief), len(brief.split())
    units = re.findall(r"[\u4e00-\u9fff]|[A-Za-z0-9][\w./,+-]*", brief)
    return brief, re.findall(r".+?[。！？]", brief), len(units)


def test_every_stage_page_opens_its_interview_answer_with_a_short_one_in_both_languages():
    english = sorted(p for p in STAGES.glob("*.md") if not p.name.endswith(".zh.md"))
    assert len(english) == 16
    for page in english:
        translated = page.with_name(page.name.replace(".md", ".zh.md"))
        for version, language in ((page, "en"), (translated, "zh")):
            brief, sentences, words = in_short(version)
            assert "".join(sentences).replace(" ", "") == brief.replace(" ", ""), f"{version.name}: whole sentences"
            assert 1 <= len(sentences) <= 2, f"{version.name}: {len(sentences)} sentences"
            assert 15 <= words <= IN_SHORT[language][2], f"{version.name}: {words} words"
        assert re.search(r"[\u4e00-\u9fff]", in_short(translated)[0]), f"{translated.name} answers in Chinese"


# Stage 0 ------------------------------------------------------------------------------------


def test_stage0_kv_memory_per_token():
    opt13b = kv_bytes_per_token(40, 40, 128, torch.float16)  # 40 layers, 40 heads of 128, float16
    check(0, 0, f"{opt13b:,}", kib(opt13b))
    llama3_8b = kv_bytes_per_token(32, 8, 128, torch.bfloat16)  # 32 layers, 8 KV heads of 128
    check(0, 1, kib(llama3_8b), f"{2048 * llama3_8b // 2**20:,}")


def test_references_correct_the_seed_articles_kv_size_with_the_computed_one():
    text = (STAGES.parent / "references.md").read_text(encoding="utf-8")
    section = text[text.index("{ #seed-article }"):text.index("\n## ", text.index("{ #seed-article }"))]
    per_token = kv_bytes_per_token(40, 40, 128, torch.float16)  # OPT-13B
    assert f"= {per_token:,} bytes = {kib(per_token)} KiB" in section
    assert f"{1000 * per_token / 1e6:.1f} MB ({1000 * per_token / 2**20:.0f} MiB)" in section
    assert "208 KB" in section  # the figure it corrects


def test_home_page_reads_its_figure_right():
    """The home page's paragraph under the contiguous/paged figure gives the figure's numbers."""
    svg = (STAGES.parent / "figures" / "paged_memory.svg").read_text(encoding="utf-8")
    held, reserved = map(int, re.search(r"(\d+) of (\d+) reserved slots hold K/V", svg).groups())
    assert "pale: reserved, no K/V yet" in svg  # not "never used": some of it will be
    home = (STAGES.parent / "index.md").read_text(encoding="utf-8")
    assert f"only {held} of the {reserved} reserved slots hold K/V" in home


def test_stage0_max_policy_admits_a_fixed_number_of_requests():
    cache = ContiguousKVCache(16384, 2048, "max", num_layers=0)
    admitted = 0
    while cache.can_allocate(1, 1):
        cache.allocate(admitted, 1, 1)
        admitted += 1
    check(0, 2, admitted)


def test_stage0_pow2_reservation_and_its_internal_fragmentation():
    cache = ContiguousKVCache(1024, 1024, "pow2", num_layers=0)
    slab = cache.allocate("r", 100, 5)
    cache.append("r", 100)
    cache.append("r", 5)
    check(0, 3, slab.size, cache.usage().internal)


def test_stage0_external_fragmentation_refuses_a_request_that_free_memory_could_hold():
    cache = ContiguousKVCache(64, 64, "oracle", num_layers=0)
    for name in "ABC":
        cache.allocate(name, 10, 10)
    cache.free("A")
    cache.free("C")
    usage = cache.usage(next_reservation=cache.reservation(15, 15))
    assert not cache.can_allocate(15, 15)
    check(0, 4, usage.external + usage.free, "no", usage.external)


# Stage 1 ------------------------------------------------------------------------------------


def test_stage1_blocks_for_a_prompt():
    manager = BlockSpaceManager(BlockAllocator(8), block_size=16)
    manager.allocate("p", list(range(37)))
    blocks = len(manager.get_block_table("p"))
    check(1, 0, blocks, blocks * 16 - 37)


def test_stage1_which_block_comes_next():
    pool = BlockAllocator(8)
    pool.allocate(3)
    pool.allocate(2)
    pool.free(1)
    (block,) = pool.allocate(1)
    check(1, 1, block)


def test_stage1_all_or_nothing():
    pool = BlockAllocator(8)
    pool.allocate(5)
    with pytest.raises(OutOfBlocksError) as refused:
        pool.allocate(4)
    check(1, 2, refused.value.num_requested, refused.value.num_free, pool.num_free_blocks)


def test_stage1_how_many_sequences_fit_in_blocks():
    manager = BlockSpaceManager(BlockAllocator(16384 // 16), block_size=16)
    fitted = 0
    while manager.can_allocate(100):
        manager.allocate(fitted, [0] * 100)
        fitted += 1
    check(1, 3, fitted, 16 - 100 % 16)


# Stage 2 ------------------------------------------------------------------------------------


def test_stage2_block_table_and_slot():
    manager = BlockSpaceManager(BlockAllocator(8), block_size=4)
    manager.allocate("A", list(range(6)))
    manager.allocate("B", list(range(3)))
    for _ in range(3):
        manager.append_slot("A")
    table = manager.get_block_table("A")
    check(2, 0, str(table), manager.slot_of("A", 8))


def test_stage2_block_tables_tensor_shape():
    manager = BlockSpaceManager(BlockAllocator(16), block_size=16)
    for name, length in (("a", 5), ("b", 40), ("c", 17)):
        manager.allocate(name, list(range(length)))
    tables = manager.block_tables_tensor(["a", "b", "c"])
    check(2, 1, f"{tables.shape[0]} × {tables.shape[1]}")


def test_stage2_worst_case_waste():
    manager = BlockSpaceManager(BlockAllocator(16384 // 16), block_size=16)
    for seq in range(31):
        manager.allocate(seq, [0] * 17)  # one token in the last block: the worst case
    usage = manager.usage()
    check(2, 2, usage.internal, f"{100 * usage.internal / usage.total:.1f}%")


def test_stage2_allocate_returns_no_cached_tokens():
    manager = BlockSpaceManager(BlockAllocator(8), block_size=16)
    check(2, 3, manager.allocate("p", list(range(20))))


def test_stage2_where_the_memory_goes_table_is_the_demo():
    """The table of stage 2's page: `make demo`'s trace, 16,384 slots, blocks of 16."""
    requests = synthetic_requests(300, rate=0.2, seed=0)  # the demo's defaults
    rows = [simulate_contiguous(requests, p, 16384, 2048) for p in ("max", "pow2", "oracle")]
    rows.append(simulate_paged(requests, 16384 // 16, 16))
    text = PAGES[2].read_text(encoding="utf-8")
    for label, row in zip(("contiguous, `max`", "contiguous, `pow2`", "contiguous, `oracle`",
                           "paged, blocks of 16"), rows, strict=True):
        cells = f"| {label} | {100 * row.fractions['token']:.0f}% | {row.mean_running:.1f} |"
        assert cells in text, cells


# Stage 3 ------------------------------------------------------------------------------------


def forked(prompt_len: int, samples: int) -> CowBlockSpaceManager:
    manager = CowBlockSpaceManager(RefCountedBlockAllocator(32), block_size=16)
    manager.allocate(0, list(range(prompt_len)))
    for child in range(1, samples):
        manager.fork(0, child)
    return manager


def used(manager) -> int:
    return manager.num_total_blocks - manager.num_free_blocks


def test_stage3_fork_shares_every_block():
    manager = forked(40, 4)
    check(3, 0, used(manager), manager.ref_count(manager.get_block_table(0)[0]))


def test_stage3_copy_on_write_copies_the_partial_block():
    manager = forked(40, 4)
    for seq in range(4):
        manager.append_slot(seq)
    check(3, 1, used(manager), len(manager.take_copies()))


def test_stage3_full_blocks_are_never_copied():
    manager = forked(48, 4)
    for seq in range(4):
        manager.append_slot(seq)
    check(3, 2, used(manager), len(manager.take_copies()))


def test_stage3_freeing_a_sample_drops_one_reference():
    manager = forked(40, 4)
    for seq in range(4):
        manager.append_slot(seq)
    manager.free(3)
    check(3, 3, manager.ref_count(manager.get_block_table(0)[0]))


# Stage 4 ------------------------------------------------------------------------------------


def visible_keys(seq_len: int, num_queries: int) -> list[int]:
    """How many keys each query attends to, read off the attention itself: all keys are
    equal (uniform weights) and each value is its position, so a query's output is the
    mean of the positions it sees, (n - 1) / 2."""
    block_size, head_dim = 16, 4
    num_blocks = math.ceil(seq_len / block_size)
    positions = torch.arange(num_blocks * block_size, dtype=torch.float32)
    key_cache = torch.zeros(num_blocks, block_size, 1, head_dim)
    value_cache = positions.reshape(num_blocks, block_size, 1, 1).expand(-1, -1, 1, head_dim).contiguous()
    out = paged_attention_ref(torch.ones(num_queries, 1, head_dim), key_cache, value_cache,
                              torch.arange(num_blocks, dtype=torch.int32)[None],
                              torch.tensor([seq_len], dtype=torch.int32),
                              query_start_loc=torch.tensor([0, num_queries], dtype=torch.int32))
    return [round(2 * m + 1) for m in out[:, 0, 0].tolist()]


def test_stage4_causal_queries_at_the_end():
    seen = visible_keys(100, 5)
    check(4, 0, seen[0], seen[-1])


def test_stage4_grouped_query_heads_read_their_kv_head():
    num_heads, num_kv_heads, head_dim = 14, 2, 8
    key_cache = torch.zeros(1, 16, num_kv_heads, head_dim)
    value_cache = torch.arange(num_kv_heads, dtype=torch.float32).reshape(1, 1, num_kv_heads, 1).expand(
        1, 16, num_kv_heads, head_dim).contiguous()  # every value of KV head h is h
    out = paged_attention_ref(torch.randn(1, num_heads, head_dim), key_cache, value_cache,
                              torch.zeros(1, 1, dtype=torch.int32), torch.tensor([10], dtype=torch.int32))
    check(4, 1, round(out[0, 9, 0].item()))


# Stage 5 ------------------------------------------------------------------------------------


def test_stage5_partitions_of_split_kv():
    check(5, 0, PARTITION_SIZE, math.ceil(1200 / PARTITION_SIZE))


def test_stage5_programs_of_v1_and_v2():
    seqs, kv_heads, context = 1, 8, 32768
    check(5, 1, seqs * kv_heads, seqs * kv_heads * math.ceil(context / PARTITION_SIZE))


def test_stage5_decode_reads_the_whole_cache():
    per_token = kv_bytes_per_token(32, 8, 128, torch.bfloat16)
    total = 64 * 2048 * per_token
    check(5, 3, f"{total / 2**30:.0f}", f"{total / 3.35e12 * 1e3:.1f}")


# Stage 6 ------------------------------------------------------------------------------------


def run(scheduler: Scheduler, steps: int = 1000, on_step=None) -> None:
    """A model-free serving loop: every scheduled sequence gets a token; finish at max_tokens."""
    for _ in range(steps):
        if not scheduler.has_unfinished():
            return
        out = scheduler.schedule()
        if on_step:
            on_step(out)
        for group in out.scheduled_groups:
            for seq in group.seqs_with(SequenceStatus.RUNNING):
                seq.append_token(1)
                if len(seq.output_token_ids) >= group.max_tokens:
                    scheduler.finish(seq)


def scheduler(num_blocks: int, block_size: int, max_model_len: int, **kwargs) -> Scheduler:
    cpu = kwargs.pop("num_cpu_blocks", 0)
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(num_blocks), block_size,
                                    RefCountedBlockAllocator(cpu) if cpu else None)
    return Scheduler(manager, max_model_len=max_model_len, watermark=0.0, **kwargs)


def request(name: str, prompt_len: int, max_tokens: int) -> SequenceGroup:
    return SequenceGroup(name, [Sequence(list(range(prompt_len)))], max_tokens=max_tokens)


def test_stage6_the_newest_request_is_preempted():
    s = scheduler(5, 4, 20)
    for name in "ABC":
        s.add(request(name, 4, 8))
    victims = []
    run(s, 3, lambda out: victims.extend(g.request_id for g in out.preempted))
    check(6, 0, victims[0])


def test_stage6_a_new_prompt_joins_the_decodes_in_one_step():
    s = scheduler(64, 16, 256)
    s.add(request("A", 10, 50))
    run(s, 1)
    s.add(request("B", 20, 50))
    out = s.schedule()
    assert [(g.request_id, n) for (_, n), g in zip(out.scheduled, out.scheduled_groups, strict=True)] == [
        ("A", 1), ("B", 20)]  # the running decode first, then the new prompt, in one step
    check(6, 1, sum(n for _, n in out.scheduled), len(out.scheduled))


def test_stage6_recompute_prefills_the_generated_tokens_too():
    s = scheduler(44, 1, 44)
    s.add(request("A", 12, 30))
    s.add(request("B", 20, 20))
    b = s.waiting[1].seqs[0]
    events = []

    def watch(out):
        if any(g.request_id == "B" for g in out.preempted):
            events.append(("preempted", len(b.output_token_ids)))
        for seq, n in out.scheduled:
            if seq is b and n > 1:
                events.append(("prefill", n))

    run(s, 200, watch)
    (_, first), (_, generated), (_, again) = events[:3]
    assert first == 20
    check(6, 2, generated, again)


def test_stage6_watermark():
    s = Scheduler(SwapBlockSpaceManager(RefCountedBlockAllocator(1000), 16), max_model_len=2048)
    check(6, 3, s.watermark_blocks)


def test_stage6_a_full_swap_space_falls_back_to_recompute():
    s = scheduler(8, 4, 32, preemption_mode="swap", num_cpu_blocks=1)
    for name in "ABC":
        s.add(request(name, 8, 8))  # two full blocks each; the CPU pool holds one block
    victims = []
    run(s, 3, lambda out: victims.extend(out.preempted))
    victim = victims[0]
    assert victim in s.waiting and all(q.status is SequenceStatus.WAITING for q in victim.seqs)
    assert not s.swapped
    check(6, 4, "recomputed")


# Stage 7 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage7_llm():
    from minipaged import LLM

    return LLM(model="tiny", stage=7, num_gpu_blocks=64, seed=0)


def test_stage7_kv_bytes_of_the_tiny_model(stage7_llm):
    c = stage7_llm.model_config
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
    assert per_token == c.kv_bytes_per_token(torch.float32)
    check(7, 0, c.num_layers, c.num_kv_heads, c.head_dim, f"{per_token:,}")


def test_stage7_steps_of_one_request(stage7_llm):
    before = stage7_llm.stats
    stage7_llm.generate([{"prompt_token_ids": list(range(5, 15))}],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    after = stage7_llm.stats
    check(7, 1, after.steps - before.steps, after.prefill_tokens - before.prefill_tokens,
          after.decode_tokens - before.decode_tokens)


def test_stage7_n_samples_prefill_n_times(stage7_llm):
    before = stage7_llm.stats
    stage7_llm.generate([{"prompt_token_ids": list(range(5, 25))}],
                        SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True), use_tqdm=False)
    check(7, 2, stage7_llm.stats.prefill_tokens - before.prefill_tokens)


def test_stage7_worst_case_blocks_of_a_request():
    manager = BlockSpaceManager(BlockAllocator(8), block_size=16)
    check(7, 3, manager.blocks_needed(40 + 30))


# Stage 8 ------------------------------------------------------------------------------------


def test_stage8_shared_samples_hold_fewer_blocks():
    from minipaged import LLM

    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(5, 45))}]  # 40 tokens
    shared = LLM(model="tiny", stage=8, num_gpu_blocks=64)
    shared.generate(prompt, params, use_tqdm=False)
    unshared = LLM(model="tiny", stage=7, num_gpu_blocks=64)
    unshared.generate(prompt, params, use_tqdm=False)
    check(8, 0, shared.stats.peak_blocks_used, unshared.stats.peak_blocks_used,
          shared.stats.prefill_tokens, unshared.stats.prefill_tokens)


# Stage 9 ------------------------------------------------------------------------------------


def cached_manager(*prompts: list[int]) -> PrefixCachingBlockSpaceManager:
    """A manager whose cache holds the full blocks of ``prompts`` (each prefilled, then freed)."""
    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(32), block_size=16)
    for i, prompt in enumerate(prompts):
        manager.allocate(("old", i), prompt)
        manager.append_slot(("old", i))  # the step that computed the prompt succeeded
        manager.free(("old", i))
    return manager


def test_stage9_a_shared_system_prompt_is_reused_block_by_block():
    system = list(range(100, 150))  # 50 tokens
    manager = cached_manager(system + list(range(10)))
    check(9, 0, manager.allocate("new", system + list(range(20, 30))))


def test_stage9_the_last_token_is_always_computed():
    prompt = list(range(200, 232))  # 32 tokens
    manager = cached_manager(prompt)
    check(9, 1, manager.allocate("again", prompt))


def test_stage9_a_block_is_named_by_its_whole_prefix():
    first, second = list(range(300, 316)), list(range(400, 416))
    manager = cached_manager(first + second + [7])
    check(9, 2, manager.allocate("other", list(range(500, 516)) + second + [7]))


def test_stage9_a_finished_request_is_evicted_tail_first():
    manager = cached_manager()
    manager.allocate("r", list(range(48)) + [1])  # 3 full blocks, and the last token in a 4th
    manager.append_slot("r")  # the prompt was computed: its 3 full blocks are cached
    table = manager.get_block_table("r")
    manager.free("r")  # last block first: the 4th (never cached) to the pool, then 3, 2, 1 to the evictor
    pool = manager.allocator
    pool.allocate(pool.num_total_blocks - 3)  # every block that holds nothing cached
    (evicted,) = pool.allocate(1)
    check(9, 3, table.index(evicted) + 1)


# The worked examples in the pages' text ---------------------------------------------------------


def test_stage0_text_opt13b_arithmetic():
    per_token = kv_bytes_per_token(40, 40, 128, torch.float16)
    text = PAGES[0].read_text(encoding="utf-8")
    assert f"= {per_token:,} bytes = {kib(per_token)} KiB per token" in text
    assert f"2048 tokens needs {2048 * per_token // 2**20:,} MiB" in text


def test_stage3_text_shared_system_prompt():
    blocks = {}
    for shared in (False, True):
        manager = CowBlockSpaceManager(RefCountedBlockAllocator(512), block_size=16)
        prompt = list(range(200))
        manager.allocate(0, prompt)
        for seq in range(1, 16):
            manager.fork(0, seq) if shared else manager.allocate(seq, prompt)
        for seq in range(16):
            for _ in range(40):
                manager.append_slot(seq)
        blocks[shared] = used(manager)
    saved = round(100 * (1 - blocks[True] / blocks[False]))
    assert f"{blocks[False]} blocks unshared, {blocks[True]} shared ({saved}% saved" in PAGES[3].read_text(
        encoding="utf-8")


def test_stage8_text_parallel_sampling_table():
    from minipaged import LLM

    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(5, 39))}]  # 34 tokens
    rows = []
    for stage in (8, 7):  # shared, then unshared
        llm = LLM(model="tiny", stage=stage, num_gpu_blocks=64)
        llm.generate(prompt, params, use_tqdm=False)
        rows.append((llm.stats.peak_blocks_used, llm.stats.prefill_tokens))
    text = PAGES[8].read_text(encoding="utf-8")
    assert f"| stage 8: one request, `n = 4`, shared | {rows[0][0]} | {rows[0][1]} |" in text
    assert f"| stage 7: four requests seeded one apart, unshared | {rows[1][0]} | {rows[1][1]} |" in text


def test_stage9_text_shared_system_prompt():
    """The example of stage 9's page, as tutorial 09 runs it."""
    from minipaged import LLM

    system = ("You answer questions about Python's standard library. Return the value of the attribute. "
              "Return a new list. Raise ValueError if the argument is negative. Return True if the path exists. ")
    questions = ["Read and return", "Create a new", "Convert the given", "Set the current", "If the file"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    stats = {}
    for caching in (False, True):
        llm = LLM("tiny", stage=9, num_gpu_blocks=128, block_size=16, enable_prefix_caching=caching)
        llm.generate([system + "Return the number of"], params, use_tqdm=False)
        llm.generate([system + q for q in questions], params, use_tqdm=False)
        stats[caching] = llm.stats
    tokens = len(llm.tokenizer.encode(system).ids)
    in_words = {6: "six"}[1 + len(questions)]
    expected = (f"A {tokens}-token system prompt in front of {in_words} questions, blocks of 16: "
                f"{stats[False].prefill_tokens} prefill tokens without caching, {stats[True].prefill_tokens} "
                f"with ({stats[True].prefix_cache_hits} block hits)")
    assert expected in " ".join(PAGES[9].read_text(encoding="utf-8").split())


# Stage 10 ------------------------------------------------------------------------------------

PAGE10 = STAGES / "10_v1_scheduler.md"


def check10(index: int, *expected) -> None:
    check_both(PAGE10, index, *expected)


def v1_scheduler(budget: int, block_size: int = 4, num_blocks: int = 64):
    from minipaged.stage10_kv_cache_manager import KVCacheManager
    from minipaged.stage10_v1_scheduler import V1Scheduler

    manager = PrefixCachingBlockSpaceManager(PrefixCachingAllocator(num_blocks), block_size)
    return V1Scheduler(KVCacheManager(manager), max_num_batched_tokens=budget,
                       max_model_len=num_blocks * block_size)


def v1_add(scheduler, name, prompt, max_tokens=4):
    from minipaged.stage7_engine import Request, SampledSequence

    request = Request(name, [SampledSequence(list(prompt))], max_tokens)
    scheduler.add(request)
    return request


def v1_step(scheduler) -> dict:
    """One step, the model played by appending token 7 to each request whose tokens are all computed."""
    out = scheduler.schedule()
    for request in out.scheduled:
        seq = request.seqs[0]
        if seq.num_computed_tokens == len(seq):
            seq.append_token(7)
            if len(seq.output_token_ids) == request.max_tokens:
                scheduler.finish(seq)
    return out


def test_stage10_page_ends_with_a_self_check_and_an_interview_answer():
    for page, headings in ((PAGE10, ("## Self-check", "## Explain it in an interview")),
                           (PAGE10.with_name("10_v1_scheduler.zh.md"),
                            ("{#self-check}", "{#explain-it-in-an-interview}"))):
        text = page.read_text(encoding="utf-8")
        assert 4 <= len(answers(page)) <= 6 and len(answers(page)) == len(answers(PAGE10)), page.name
        assert text.index(headings[0]) < text.index(headings[1]), page.name
        bold = [bool(bold_spans(page, i)) for i in range(len(answers(page)))]
        assert bold == [True] * 4 + [False, True]  # the 5th is answered in words


def test_stage10_a_long_prompt_behind_three_decodes():
    scheduler = v1_scheduler(budget=16)
    for name in "abc":
        v1_add(scheduler, name, [ord(name)], max_tokens=20)
    v1_step(scheduler)
    prompt = v1_add(scheduler, "p", range(100, 140))
    first, steps = None, 0
    while not prompt.seqs[0].output_token_ids:
        out = v1_step(scheduler)
        steps += 1
        first = first or out.num_scheduled_tokens["p"]
    check10(0, first, steps)


def test_stage10_a_budget_of_one_token():
    scheduler = v1_scheduler(budget=1)
    v1_add(scheduler, "a", range(10, 15), max_tokens=3)
    steps = 0
    while scheduler.has_unfinished():
        v1_step(scheduler)
        steps += 1
    check10(1, steps)


def test_stage10_a_cached_prefix_then_chunks():
    scheduler = v1_scheduler(budget=64, block_size=16)
    v1_add(scheduler, "a", range(100, 150), max_tokens=2)
    while scheduler.has_unfinished():
        v1_step(scheduler)
    scheduler.max_num_batched_tokens = 8
    new = v1_add(scheduler, "b", list(range(100, 140)) + list(range(500, 510)))
    cached = v1_step(scheduler).scheduled_new_reqs[0].num_computed_tokens
    steps = 1
    while not new.seqs[0].output_token_ids:
        v1_step(scheduler)
        steps += 1
    check10(2, cached, steps)


def test_stage10_the_newest_running_request_is_preempted():
    scheduler = v1_scheduler(budget=64, num_blocks=6)
    for name in "ABC":
        v1_add(scheduler, name, [ord(name)] * 4, max_tokens=9)  # one full block each
    v1_step(scheduler)
    v1_step(scheduler)  # each decodes into a second block: all 6 are in use
    out = v1_step(scheduler)
    while not out.preempted:
        out = v1_step(scheduler)
    assert list(out.num_scheduled_tokens)[0] == "A"
    check10(3, out.preempted[0].request_id)


def test_stage10_async_scheduling_computes_one_token_more_when_a_stop_token_comes():
    from minipaged import LLM

    prompt = {"prompt_token_ids": [11, 12, 13]}
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = LLM("tiny").generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[2] not in tokens[:2]  # the third token is the first stop
    stop = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[2]])
    computed, outs = [], []
    for flag in (False, True):
        llm = LLM("tiny", async_scheduling=flag)
        outs.append(llm.generate([prompt], stop, use_tqdm=False)[0].outputs[0])
        assert llm.engine.step() == []  # a step still in flight is done and counted; nothing else runs
        computed.append(llm.stats.prefill_tokens + llm.stats.decode_tokens)
    assert outs[0].token_ids == outs[1].token_ids == tokens[:3] and outs[1].finish_reason == "stop"
    check10(5, computed[1] - computed[0])


# Stage 11 ------------------------------------------------------------------------------------

PAGE11 = STAGES / "11_tensor_parallel.md"
LLAMA3_70B = dict(model_type="llama", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                  num_kv_heads=8, head_dim=128, intermediate_size=28672, max_position_embeddings=8192, norm_eps=1e-5)
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                  num_kv_heads=2, head_dim=64, intermediate_size=4864, max_position_embeddings=32768, norm_eps=1e-6)
NVLINK_ONE_WAY = 450e9  # an H100 SXM's NVLink: 900 GB/s, both directions together


def check11(index: int, *expected) -> None:
    check_both(PAGE11, index, *expected)


def all_reduce_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """Two row-parallel layers a layer and the embedding, each a (tokens, hidden_size) tensor."""
    return (2 * config.num_layers + 1) * tokens * config.hidden_size * dtype_bytes


def ring_all_reduce_ms(num_bytes: int, ranks: int) -> float:
    """The least time a ring all-reduce of ``num_bytes`` takes: each GPU sends 2(N - 1)/N of them."""
    return 2 * (ranks - 1) / ranks * num_bytes / NVLINK_ONE_WAY * 1e3


def test_stage11_page_ends_with_a_self_check_and_an_interview_answer():
    for page, headings in ((PAGE11, ("## Self-check", "## Explain it in an interview")),
                           (PAGE11.with_name("11_tensor_parallel.zh.md"),
                            ("{#self-check}", "{#explain-it-in-an-interview}"))):
        text = page.read_text(encoding="utf-8")
        assert 4 <= len(answers(page)) <= 6 and len(answers(page)) == len(answers(PAGE11)), page.name
        assert text.index(headings[0]) < text.index(headings[1]), page.name
        bold = [bool(bold_spans(page, i)) for i in range(len(answers(page)))]
        assert bold == [True] * 4 + [False] * 2  # the last two are answered in words


def test_stage11_the_bytes_a_rank_all_reduces_are_the_formulas():
    """Measured on the workers (tp 2), step by step, and equal to the formula."""
    from minipaged import LLM

    with LLM("tiny", stage=11, tensor_parallel_size=2, num_gpu_blocks=16) as llm:
        counts = [llm.executor.collective_rpc("count_all_reduce_bytes")]
        llm.engine.add_request("r", {"prompt_token_ids": list(range(5, 15))},
                               SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            counts.append(llm.executor.collective_rpc("count_all_reduce_bytes"))
        steps = [[b - a for a, b in zip(before, after, strict=True)] for before, after in zip(counts, counts[1:])]
        c = llm.model_config
    assert steps == [[all_reduce_bytes(c, n, 4)] * 2 for n in (10, 1, 1)]  # the prompt, then two decodes
    check11(0, f"{steps[0][0]:,}", f"{steps[1][0]:,}")
    assert f"9 × 128 × 4 = {all_reduce_bytes(c, 1, 4):,}" in PAGE11.read_text(encoding="utf-8")


def test_stage11_llama3_70b_at_tp8_over_nvlink():
    from minipaged.models import ModelConfig

    c = ModelConfig(**LLAMA3_70B)
    decode, chunk = all_reduce_bytes(c, 256, 2), all_reduce_bytes(c, 2048, 2)
    check11(1, f"{chunk:,}", f"{ring_all_reduce_ms(chunk, 8):.1f}")
    for page in (PAGE11, PAGE11.with_name("11_tensor_parallel.zh.md")):
        text = " ".join(page.read_text(encoding="utf-8").split())
        assert f"(2 × 80 + 1) × 256 × 8192 × 2 = {decode:,}" in text, page.name
        assert f"{2 * 7 / 8 * decode / 1e9:.2f} GB" in text and f"{ring_all_reduce_ms(decode, 8):.1f} ms" in text
        assert f"{all_reduce_bytes(c, 1, 2) / 1e6:.1f} MB" in text, page.name  # a token's, in the interview answer


def test_stage11_what_a_rank_of_qwen25_holds():
    from minipaged.models import ModelConfig
    from minipaged.models.parallel import check_tensor_parallel, shard_config

    c = ModelConfig(**QWEN25_05B)
    shard = shard_config(c, 2)
    per_token = shard.kv_bytes_per_token(torch.bfloat16)
    assert 2 * per_token == c.kv_bytes_per_token(torch.bfloat16)
    with pytest.raises(ValueError):
        check_tensor_parallel(c, 4)
    check11(2, shard.num_heads, shard.num_kv_heads, f"{per_token:,}", "refused")


def test_stage11_a_replicated_kv_head():
    from minipaged.models import ModelConfig
    from minipaged.models.parallel import kv_heads_of_rank

    c = ModelConfig(**LLAMA3_70B)
    holders = [[r for r in range(16) if head in kv_heads_of_rank(c, r, 16)] for head in range(c.num_kv_heads)]
    assert len({len(h) for h in holders}) == 1
    (head,) = kv_heads_of_rank(c, 11, 16)
    queries = range(11 * 4, 12 * 4)  # rank 11's query heads; head h reads KV head h // 8
    assert {q // (c.num_heads // c.num_kv_heads) for q in queries} == {head}
    check11(3, len(holders[0]), head)


# Stage 12 ------------------------------------------------------------------------------------

PAGE12 = STAGES / "12_speculative.md"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def check12(index: int, *expected) -> None:
    check_both(PAGE12, index, *expected)


def test_stage12_page_ends_with_a_self_check_and_an_interview_answer():
    for page, headings in ((PAGE12, ("## Self-check", "## Explain it in an interview")),
                           (PAGE12.with_name("12_speculative.zh.md"),
                            ("{#self-check}", "{#explain-it-in-an-interview}"))):
        text = page.read_text(encoding="utf-8")
        assert 4 <= len(answers(page)) <= 6 and len(answers(page)) == len(answers(PAGE12)), page.name
        assert text.index(headings[0]) < text.index(headings[1]), page.name
        bold = [bool(bold_spans(page, i)) for i in range(len(answers(page)))]
        assert bold == [True] * 5 + [False]  # the last is answered in words


def test_stage12_the_step_in_the_figure():
    """The figure's step (scripts/doc_figures.py draws the same one): the first step with drafts."""
    from minipaged import LLM

    llm = LLM("tiny", block_size=4, num_gpu_blocks=64, speculative_config=NGRAM)
    engine = llm.engine
    engine.add_request("A", {"prompt_token_ids": llm.tokenizer.encode("Return the number of").ids},
                       SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    seq = engine.requests["A"].seqs[0]
    drafts = None
    while not drafts:
        before = len(seq)
        engine.step()
        drafts = engine.last_scheduler_output.scheduled_spec_decode_tokens.get("A")
    out = engine.last_scheduler_output
    kept = seq.token_ids[before:]
    accepted = llm.stats.spec_decoding.num_accepted_tokens
    assert before == 12 and len(drafts) == 4 and kept[:accepted] == drafts[:accepted]
    rolled_back = llm.scheduler.block_manager.table(seq.seq_id).num_tokens - seq.num_computed_tokens
    check12(0, out.num_scheduled_tokens["A"], len(kept), rolled_back, seq.num_computed_tokens)


def test_stage12_drafts_are_cut_to_the_budget_left():
    from minipaged import LLM

    class FourDrafts:
        def propose(self, token_ids):
            return [token_ids[-1]] * 4

    llm = LLM("tiny", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=6, speculative_config=NGRAM)
    engine = llm.engine
    for name, prompt in (("A", [5, 6, 7]), ("B", [8, 9, 10])):  # both prompts fit the first step's budget
        engine.add_request(name, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.spec_decoder.proposer = FourDrafts()
    engine.step()
    engine.step()
    out = engine.last_scheduler_output
    assert list(out.scheduled_spec_decode_tokens) == ["A"]
    check12(1, out.num_scheduled_tokens["A"], out.num_scheduled_tokens["B"])


def test_stage12_tokens_a_step_gives_on_average():
    """Leviathan et al.'s expectation, as the mean acceptance length of drafts kept with probability 0.8."""
    from minipaged.stage12_speculative import SpecDecodingStats

    alpha, k, drafts = 0.8, 4, 10**6
    accepted = sum(alpha**i for i in range(1, k + 1))  # P(at least i drafts kept) = alpha^i
    stats = SpecDecodingStats(num_drafts=drafts, num_draft_tokens=k * drafts,
                              num_accepted_tokens=round(accepted * drafts))
    assert stats.mean_acceptance_length == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    check12(2, f"{stats.mean_acceptance_length:.2f}", f"{stats.mean_acceptance_length / 1.4:.2f}")


def frequencies(p, q, draws: int = 20000) -> torch.Tensor:
    """How often ``accept_or_resample`` returns each token, drafts drawn from ``q`` (seeded)."""
    from minipaged.stage12_rejection_sampler import RejectionSampler

    generator, counts = torch.Generator().manual_seed(0), torch.zeros(len(p))
    for _ in range(draws):
        draft = int(torch.multinomial(q, 1, generator=generator))
        counts[RejectionSampler.accept_or_resample(p, q, draft, generator)] += 1
    return counts / draws


def test_stage12_an_ngram_draft_is_kept_with_its_probability():
    p, q = torch.tensor([0.3, 0.5, 0.2]), torch.tensor([1.0, 0.0, 0.0])  # x, y, z; q one-hot at x
    residual = (p - q).clamp(min=0)
    residual /= residual.sum()
    kept = float(torch.minimum(p, q).sum())
    freq = frequencies(p, q)
    assert bool(((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / 20000)).all())  # the code gives p
    check12(3, f"{kept:.1f}", f"{float(residual[1]):.3f}", f"{float(residual[2]):.3f}")


def test_stage12_a_draft_models_proposal_is_kept_as_often_as_p_and_q_overlap():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    overlap = float(torch.minimum(p, q).sum())
    (only,) = torch.nonzero((p - q).clamp(min=0)).flatten().tolist()  # the residual's one token
    assert bool(((frequencies(p, q) - p).abs() <= 5 * torch.sqrt(p * (1 - p) / 20000)).all())
    check12(4, f"{overlap:.1f}", only)


# --- stage 13: an FP8 KV cache

PAGE13 = STAGES / "13_fp8_kv_cache.md"


def check13(index: int, *expected) -> None:
    check_both(PAGE13, index, *expected)


def test_stage13_page_ends_with_a_self_check_and_an_interview_answer():
    for page, headings in ((PAGE13, ("## Self-check", "## Explain it in an interview")),
                           (PAGE13.with_name("13_fp8_kv_cache.zh.md"),
                            ("{#self-check}", "{#explain-it-in-an-interview}"))):
        text = page.read_text(encoding="utf-8")
        assert len(answers(page)) == len(answers(PAGE13)) == 5, page.name
        assert text.index(headings[0]) < text.index(headings[1]), page.name
        assert [bool(bold_spans(page, i)) for i in range(5)] == [True] * 4 + [False]  # the last in words


def test_stage13_a_key_stored_and_read_back():
    from minipaged.stage13_fp8_kv_cache import dequantize_fp8, fp8_rounding_bound, quantize_fp8

    key, scale = torch.tensor([0.37]), 0.01
    stored = quantize_fp8(key, scale)
    back = dequantize_fp8(stored, scale)
    bound = float(fp8_rounding_bound(key, scale))
    assert abs(float(back) - 0.37) <= bound
    check13(0, f"{float(stored.float()):g}", f"{float(back):.2f}", f"{bound:.6f}")


def test_stage13_calibrated_scales_and_a_key_that_saturates():
    from minipaged.stage13_fp8_kv_cache import FP8PagedKVCache

    cache = FP8PagedKVCache(1, 2, 2, 1, 1, calculate_kv_scales=True)
    cache.write(0, torch.tensor([0, 1]), torch.tensor([[[3.6]], [[-1.0]]]), torch.tensor([[[0.52]], [[0.1]]]))
    cache.write(0, torch.tensor([2]), torch.tensor([[[100.0]]]), torch.tensor([[[0.0]]]))
    keys, _ = cache.gather(0, [0, 1], 3)
    check13(1, f"{cache.k_scale[0]:.3f}", f"{cache.v_scale[0]:.4f}", f"{float(keys[2]):.3f}")


def test_stage13_opt13b_in_fp8():
    from minipaged.perf.simulate import OPT_13B_KV_BUDGET, OPT_13B_KV_BYTES_PER_TOKEN, requests_that_fit

    fp8_bytes = OPT_13B_KV_BYTES_PER_TOKEN // 2  # one byte a value where fp16 takes two
    slots = OPT_13B_KV_BUDGET // fp8_bytes
    assert requests_that_fit(1024, "paged") == 15
    check13(2, f"{fp8_bytes // 1024}", f"{slots:,}", requests_that_fit(1024, "paged", num_slots=slots))


def test_stage13_how_far_a_score_and_a_weight_move():
    eps = 1 / 8 * 8 * 0.01  # scale * sum|q| * the keys' rounding bound
    check13(3, f"{eps:.2f}", f"{math.exp(2 * eps):.3f}")


# --- stage 14: disaggregated prefill

PAGE14 = STAGES / "14_disaggregated_prefill.md"


def check14(index: int, *expected) -> None:
    check_both(PAGE14, index, *expected)


def test_stage14_page_ends_with_a_self_check_and_an_interview_answer():
    for page, headings in ((PAGE14, ("## Self-check", "## Explain it in an interview")),
                           (PAGE14.with_name("14_disaggregated_prefill.zh.md"),
                            ("{#self-check}", "{#explain-it-in-an-interview}"))):
        text = page.read_text(encoding="utf-8")
        assert len(answers(page)) == len(answers(PAGE14)) == 5, page.name
        assert text.index(headings[0]) < text.index(headings[1]), page.name
        assert [bool(bold_spans(page, i)) for i in range(5)] == [True] * 4 + [False]  # the last in words


def through_a_folder(folder, prompt, spoil=None):
    """The proxy's two requests in process, blocks of 16: the prompt to a producer (one token), then, once
    ``spoil`` has done what it does to the folder, the whole request to a consumer; the consumer's stats."""
    from minipaged import LLM

    sizes = dict(block_size=16, num_gpu_blocks=64, max_model_len=128)

    def engine(role):
        config = {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
        return LLM("tiny", kv_transfer_config=config, **sizes)
    engine("kv_producer").generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                   use_tqdm=False)
    if spoil is not None:
        spoil(folder)
    consumer = engine("kv_consumer")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = consumer.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == LLM("tiny", **sizes).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    return consumer.stats


PROMPT37 = {"prompt_token_ids": list(range(100, 137))}


def block_file(folder, index: int) -> Path:
    from minipaged.stage14_kv_connector import block_path, prompt_block_hashes

    return block_path(folder, prompt_block_hashes(PROMPT37["prompt_token_ids"], 16)[index])


def test_stage14_a_37_token_prompt_through_the_proxy(tmp_path):
    from minipaged.stage14_kv_connector import prompt_block_hashes

    stats = through_a_folder(tmp_path, PROMPT37)
    saved = len(prompt_block_hashes(PROMPT37["prompt_token_ids"], 16))
    assert sorted(tmp_path.iterdir()) == sorted(block_file(tmp_path, i) for i in range(saved))
    assert stats.kv_transfer.num_loaded_blocks == saved
    check14(0, saved, stats.kv_transfer.num_external_tokens, stats.prefill_tokens)


def test_stage14_what_a_qwen25_shaped_model_moves(tmp_path):
    from minipaged.common.config import KVTransferConfig
    from minipaged.models import ModelConfig
    from minipaged.stage14_kv_connector import (
        KVConnectorRole,
        SharedStorageConnector,
        prompt_block_hashes,
        read_block,
        write_block,
    )

    c = ModelConfig(**QWEN25_05B)
    connector = SharedStorageConnector(KVTransferConfig(kv_role="kv_both"), KVConnectorRole.WORKER, 16)
    connector.register_kv_caches(PagedKVCache(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim, torch.bfloat16))
    shape = connector.block_shape()
    write_block(tmp_path / "block.safetensors", torch.zeros(shape, dtype=torch.bfloat16))
    block = read_block(tmp_path / "block.safetensors", shape, torch.bfloat16)
    per_file = block.numel() * block.element_size()
    blocks = len(prompt_block_hashes(list(range(1000)), 16))
    per_token = c.kv_bytes_per_token(torch.bfloat16)
    assert per_file == 16 * per_token == c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 2
    check14(1, blocks, f"{per_file:,}", f"{blocks * per_file:,}")
    for page in (PAGE14, PAGE14.with_name("14_disaggregated_prefill.zh.md")):
        text = " ".join(page.read_text(encoding="utf-8").split())
        assert f"24 × 2 × 2 × 64 × 2 = {per_token:,}" in text, page.name  # a token's bytes, in the text
        interview = text[text.index("{#explain-it-in-an-interview}" if page.name.endswith(".zh.md")
                                    else "## Explain it in an interview"):]
        assert f"{per_token // 1024} KiB" in interview, page.name


def test_stage14_a_missing_file_stops_the_connector_at_the_gap(tmp_path):
    stats = through_a_folder(tmp_path, PROMPT37, lambda folder: block_file(folder, 1).unlink())
    assert stats.kv_transfer.num_recomputed_tokens == stats.kv_transfer.num_failed_blocks == 0
    check14(2, stats.kv_transfer.num_external_tokens, stats.prefill_tokens)


def test_stage14_a_corrupt_file_is_recomputed(tmp_path):
    def flip_a_byte_of_block_1(folder):
        path = block_file(folder, 1)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF  # a byte of the K/V: the header still reads
        path.write_bytes(bytes(data))

    stats = through_a_folder(tmp_path, PROMPT37, flip_a_byte_of_block_1)
    assert stats.kv_transfer.num_external_tokens == 32 and stats.kv_transfer.num_failed_blocks == 1
    check14(3, stats.kv_transfer.num_recomputed_tokens, stats.prefill_tokens)


# --- stage 15: a hybrid KV cache

PAGE15 = STAGES / "15_hybrid_kv_cache.md"


def check15(index: int, *expected) -> None:
    check_both(PAGE15, index, *expected)


def test_stage15_page_ends_with_a_self_check_and_an_interview_answer():
    for page, headings in ((PAGE15, ("## Self-check", "## Explain it in an interview")),
                           (PAGE15.with_name("15_hybrid_kv_cache.zh.md"),
                            ("{#self-check}", "{#explain-it-in-an-interview}"))):
        text = page.read_text(encoding="utf-8")
        assert len(answers(page)) == len(answers(PAGE15)) == 6, page.name
        assert text.index(headings[0]) < text.index(headings[1]), page.name
        assert [bool(bold_spans(page, i)) for i in range(6)] == [True] * 4 + [False] * 2  # the last two in words


def test_stage15_the_blocks_a_window_gives_back():
    from minipaged.stage15_kv_cache_groups import SlidingWindowManager, SlidingWindowSpec

    allocator = BlockAllocator(400)
    null = allocator.allocate(1)[0]
    manager = SlidingWindowManager(SlidingWindowSpec(16, 1024), allocator, null)
    manager.allocate_new_blocks("r", 5000)
    skipped = manager.get_num_skipped_tokens(5000)
    manager.remove_skipped_blocks("r", 5000)
    manager.allocate_new_blocks("r", 5001)
    blocks = manager.req_to_blocks["r"]
    check15(0, f"{skipped:,}", blocks.count(null), len(blocks) - blocks.count(null))


def test_stage15_gemma_3s_groups():
    from minipaged.stage15_kv_cache_groups import group_size, kv_cache_groups, share_layers

    groups = kv_cache_groups([1024] * 5 + [None] + [1024] * 5 + [None], 16)
    cache = share_layers(PagedKVCache(group_size(groups), 2, 16, 1, 8), groups)
    check15(1, len(groups), group_size(groups), len({t.data_ptr() for t in cache.key_cache}))


def test_stage15_a_prefix_hit_over_a_window_whose_early_blocks_were_evicted():
    from minipaged.common.sequence import Sequence
    from minipaged.stage15_hybrid_kv_cache import HybridKVCacheCoordinator, HybridKVCacheManager
    from minipaged.stage15_kv_cache_groups import kv_cache_groups

    coordinator = HybridKVCacheCoordinator(kv_cache_groups([128], 16), 200, enable_caching=True)
    manager = HybridKVCacheManager(coordinator, 8192)
    shared = list(range(992))
    first = Sequence(shared + [5] * 8)
    manager.allocate_prompt(first)
    manager.cache_blocks(first, 1000)
    coordinator.managers[0].remove_skipped_blocks(first.seq_id, 1000)  # its window gave blocks 0 .. 53 back
    manager.free(first)  # then the rest: 54 .. 61 are the most recently freed
    taken = coordinator.allocator.allocate(coordinator.allocator.num_free_blocks - 8)  # evicts every other one
    coordinator.allocator.free(taken[0])  # one block free for the new request's last token
    second = Sequence(shared + [7] * 8)
    skipped = manager.allocate_prompt(second)
    (sliding,) = manager.block_ids(second)
    cached = sliding[:skipped // 16]
    check15(3, len(cached) - cached.count(coordinator.null_block), cached.count(coordinator.null_block), f"{skipped:,}")


def test_stage15_a_long_request_on_a_five_to_one_model():
    from minipaged.stage15_hybrid_kv_cache import HybridKVCacheCoordinator
    from minipaged.stage15_kv_cache_groups import group_size, kv_cache_groups

    groups = kv_cache_groups(([128] * 5 + [None]) * 8, 16)
    coordinator = HybridKVCacheCoordinator(groups, 4000)
    coordinator.allocate_slots("r", 0, 8192)
    coordinator.allocate_slots("r", 8192, 8193)
    held = [sum(b != coordinator.null_block for b in m.req_to_blocks["r"]) for m in coordinator.managers]
    sliding = {h for h, g in zip(held, groups, strict=True) if g.spec.__class__.__name__ == "SlidingWindowSpec"}
    (per_sliding_group,) = sliding
    check15(2, group_size(groups), per_sliding_group, f"{sum(held)}", f"{sum(held) * group_size(groups):,}",
            f"{-(-8193 // 16) * 48:,}")
