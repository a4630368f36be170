"""The soak's short version (bench/soak.py runs 300 steps and 6 kills): 40 steps of the tiny run
with a checkpoint every 5, SIGKILLed at 3 random points (seeded) and resumed each time, ends with
the uninterrupted run's adapters and AdamW moments (bit for bit), metrics, samples and probes.
The runs, the kills and the comparison are support.soak, which the bench script uses too."""
import random

from support import soak


def test_three_random_sigkills_in_40_steps_end_as_the_uninterrupted_run(tiny):
    ref, _ = soak.uninterrupted(soak.recipe(tiny / "full", 40, 5))
    run, events = soak.killed_run(soak.recipe(tiny / "killed", 40, 5), tiny, kills=3, rng=random.Random(0),
                                  launcher="fork", log=lambda m: None)
    assert len(events) == 3 and all(0 <= e["steps_lost"] <= 5 for e in events)   # at most one cadence
    assert soak.compare(ref, run, 40) == {"adapters_and_moments_bit_equal": True, "metrics_equal": True,
                                          "samples_equal": True, "probes_equal": True}
