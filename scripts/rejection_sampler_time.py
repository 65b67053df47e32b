"""What vLLM's rejection sampler costs per step on this CPU, with vLLM's recovered-token sampling
and with the plugin's, side by side in one process.

    python scripts/rejection_sampler_time.py [--batch 32] [--vocab 49152] [--seeded]

Times ``RejectionSampler.forward`` (the whole sampling of a speculative step) on random logits at
temperature 0.6 for: no drafts (the plugin samples such a step like no speculation), one request
with 1 and with 4 draft tokens (a probe), and every request with 1 and with 4 draft tokens. The
plugin's other fixes (expand, empty drafts, plain sampling without drafts) are on in both arms;
only the recovered-token sampler differs. Prints median milliseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def sampling_metadata(batch: int, seeded: bool):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    generators = {i: torch.Generator().manual_seed(i) for i in range(batch)} if seeded else {}
    return SamplingMetadata(
        temperature=torch.full((batch,), 0.6), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators=generators, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(), spec_token_ids=None)


def median_ms(sampler, drafts: list[list[int]], vocab: int, seeded: bool, rounds: int) -> float:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    logits = torch.randn(len(drafts) + sum(map(len, drafts)), vocab)
    times = []
    for round_ in range(rounds + 3):
        step_logits = logits.clone()
        params = sampling_metadata(len(drafts), seeded)
        begin = time.perf_counter()
        sampler(metadata, None, step_logits, params)
        if round_ >= 3:  # the first calls warm up
            times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    parser.add_argument("--seeded", action="store_true", help="every request has its own generator")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()

    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from ngramrl.engine import vllm_plugin

    if not current_platform.is_cpu():
        raise SystemExit("this measures the CPU path: the plugin changes nothing on accelerators")
    current_platform.register_triton_kernel_overrides()  # what a CPU engine does at start
    vllm_original = rejection_sampler.sample_recovered_tokens
    vllm_plugin.register()
    plugin = rejection_sampler.sample_recovered_tokens
    sampler = RejectionSampler(Sampler())
    batch = args.batch
    shapes = {
        "no drafts": [[] for _ in range(batch)],
        "one request, 1 draft token": [[5]] + [[] for _ in range(batch - 1)],
        "one request, 4 draft tokens": [[5, 6, 7, 8]] + [[] for _ in range(batch - 1)],
        "every request, 1 draft token": [[5] for _ in range(batch)],
        "every request, 4 draft tokens": [[5, 6, 7, 8] for _ in range(batch)],
    }
    print(f"batch {batch}, vocabulary {args.vocab}, {'seeded' if args.seeded else 'unseeded'} requests, "
          f"median ms per step over {args.rounds} steps")
    print(f"{'drafts':32s} {'vLLM':>8s} {'plugin':>8s} {'ratio':>7s}")
    for name, drafts in shapes.items():
        timed = {}
        for arm, function in (("vllm", vllm_original), ("plugin", plugin)):
            rejection_sampler.sample_recovered_tokens = function
            timed[arm] = median_ms(sampler, drafts, args.vocab, args.seeded, args.rounds)
        rejection_sampler.sample_recovered_tokens = plugin
        print(f"{name:32s} {timed['vllm']:8.2f} {timed['plugin']:8.2f} {timed['vllm'] / timed['plugin']:6.2f}x")


if __name__ == "__main__":
    main()
