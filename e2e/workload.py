"""The requests the load generator sends, and the settings both the daemons and the offline reference use.

Greedy outputs are compared with the offline engine, so every setting that could change the numbers
(dtype, block size, max model length) is fixed here once and used on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_URI = "builtin://smollm2-135m"
MODEL_NAME = "smollm2"
DTYPE = "float32"  # what "auto" resolves to on an AVX2-only CPU; pinned so both sides agree
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
NUM_KV_BLOCKS = 16  # 4 running requests of <= 48 tokens hold 75% of it: pressure builds fast

# Distinct openings, 30-45 tokens each, so no two requests share KV blocks through the prefix cache.
PROMPTS: tuple[str, ...] = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built wooden machines that riders pushed along with their feet. Later designs added",
    "A good cup of tea depends on three things: fresh water, the right temperature and patience. Green tea "
    "needs cooler water than black tea, because",
    "In the small harbour town, the fishermen woke before dawn every morning. They checked their nets, "
    "loaded the boats with ice and bait, and then",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
    "chloroplasts, chlorophyll absorbs sunlight and",
    "The recipe for a simple loaf of bread needs only flour, water, salt and yeast. First, mix the dry "
    "ingredients in a large bowl, then",
    "Mount Everest, the highest mountain on Earth, rises on the border between Nepal and China. The first "
    "climbers to reach its summit were",
    "When you learn a new programming language, the best first project is a small one that you can finish "
    "in a weekend. For example, you could",
    "The library was quiet except for the ticking of the old clock above the door. Anna opened the dusty "
    "book she had found on the top shelf and read",
    "Honeybees live in colonies of tens of thousands of workers, a few hundred drones and a single queen. "
    "Each worker has a job that changes as it",
    "The train left the station at exactly seven o'clock, heading north through fields of wheat and small "
    "villages. In the dining car, a waiter",
)

# The light load while scaling in: short prompts, long answers (<= 80 tokens = 5 blocks, so one request per
# pod keeps the summed KV usage under one replica's target) that often outlast the removed pod's preStop.
TRICKLE_PROMPTS: tuple[str, ...] = (
    "Once upon a time, in a quiet village by the sea,",
    "The three most important rules of cooking are",
    "Dear diary, today was the strangest day because",
    "Here is a step by step guide to planting a tree:",
)

HEAVY_MAX_TOKENS = 16  # the scale-up load: many short requests
TRICKLE_MAX_TOKENS = 64


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    key: str


def heavy_jobs() -> list[Job]:
    return [Job(p, HEAVY_MAX_TOKENS, f"heavy-{i}") for i, p in enumerate(PROMPTS)]


def trickle_jobs() -> list[Job]:
    return [Job(p, TRICKLE_MAX_TOKENS, f"trickle-{i}") for i, p in enumerate(TRICKLE_PROMPTS)]


def all_jobs() -> list[Job]:
    """Every request the load generator may send: the reference computes each once."""
    return heavy_jobs() + trickle_jobs()
