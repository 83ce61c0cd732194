"""Generate the LongAlpaca-format sample: synthetic field reports with a question and its answer, and a tokenizer.

Every record has LongAlpaca's fields: ``instruction`` (a long document followed by a question),
``output`` (the answer, derivable from the document) and ``file`` (the name of the document). The
reports describe invented expeditions to invented islands (names are random syllables), so the
text is free of copyright and the answers can only come from reading the report. A byte-level BPE
tokenizer is trained on the records, so the sample trains without downloading anything. Both ship inside the
package (``hf_memo/data/longalpaca/``, :mod:`hf_memo.data`), where ``hf-memo demo`` and the recipe find them::

    python examples/longalpaca/make_sample.py            # rewrites hf_memo/data/longalpaca/
    python examples/longalpaca/make_sample.py --out DIR  # elsewhere

The output is deterministic: running it again reproduces the shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from hf_memo.data import LONGALPACA_DIR, LONGALPACA_SAMPLE, LONGALPACA_TOKENIZER

SAMPLE_FILE = LONGALPACA_SAMPLE.name
TOKENIZER_DIR = LONGALPACA_TOKENIZER.name
VOCAB_SIZE = 4096
DAYS = 18  # days per report: every record (with the Llama-2 template) stays under 2,048 tokens
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "sh", "br", "kr", "tr", "gl"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
CODAS = ["", "", "", "n", "r", "l", "s", "m", "th"]
ROLES = ["geologist", "botanist", "cartographer", "physician", "navigator", "archivist", "surveyor", "quartermaster"]
TERRAIN = ["valley", "ridge", "lagoon", "cave", "plateau", "bay", "marsh", "gorge", "headland", "spring"]
FINDS = ["fern", "crystal", "shell", "beetle", "stone tablet", "resin", "moss", "bone flute", "copper bead", "orchid"]
WEATHER = [
    "The morning was grey and a cold wind came from the {dir}.",
    "Rain fell from dawn until noon, and the paths turned to mud.",
    "The sky was clear and the sea lay flat under a hot sun.",
    "A thick fog covered the coast and the team waited for it to lift.",
    "Strong gusts from the {dir} bent the trees along the shore.",
]
DIRECTIONS = ["north", "south", "east", "west"]
FILLER = [
    "The {w} along the {t} were taller than any seen on the mainland.",
    "Several {w} birds circled above the camp and called until dusk.",
    "{p} wrote {n} pages in the journal and sketched the {w} trees near the {t}.",
    "The team counted {n} kinds of {w} moss on the rocks by the water.",
    "Supplies were checked: {n} crates of flour remained, and the lamp oil would last another week.",
    "In the evening {p} repaired the {w} nets while the others cooked fish over the fire.",
    "The soil near the {t} was dark and smelled of {w} roots.",
    "A small stream named {W} by the team ran {n} metres below the trail.",
]


def word(rng: random.Random, syllables: int) -> str:
    """A pronounceable invented word of ``syllables`` syllables."""
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))


def name(rng: random.Random) -> str:
    return word(rng, rng.randint(2, 3)).capitalize()


@dataclass(frozen=True)
class Member:
    name: str
    role: str
    joined: int


@dataclass(frozen=True)
class Site:
    name: str
    terrain: str
    metres: int
    find: str
    finder: Member
    day: int


def report(rng: random.Random, index: int) -> tuple[str, list[Member], list[Site], str]:
    """One report: ``(text, team, sites, island)``. Sites are listed in the order they were visited."""
    island = name(rng)
    team = [Member(name(rng), role, rng.randint(1840, 1899)) for role in rng.sample(ROLES, rng.randint(5, 7))]
    days = sorted(rng.sample(range(2, DAYS), rng.randint(4, 6)))
    sites = [
        Site(
            f"{name(rng)} {terrain}",
            terrain,
            rng.randint(3, 900),
            f"a {word(rng, 2)} {rng.choice(FINDS)}",
            rng.choice(team),
            day,
        )
        for day, terrain in zip(days, rng.sample(TERRAIN, len(days)))
    ]
    visits = {site.day: site for site in sites}
    lines = [f"Report {index}: the survey of {island}", ""]
    lines.append(
        f"The expedition reached {island} after {rng.randint(9, 40)} days at sea. "
        + " ".join(f"{m.name}, the {m.role}, had joined the society in {m.joined}." for m in team)
    )
    for day in range(1, DAYS + 1):
        sentences = [rng.choice(WEATHER).format(dir=rng.choice(DIRECTIONS))]
        for _ in range(rng.randint(2, 5)):
            sentences.append(
                rng.choice(FILLER).format(
                    w=word(rng, 2), W=name(rng), t=rng.choice(TERRAIN), p=rng.choice(team).name, n=rng.randint(2, 60)
                )
            )
        if day in visits:
            site = visits[day]
            sentences.insert(
                rng.randint(1, len(sentences)),
                f"{site.finder.name} led the team to {site.name}, {site.metres} metres above the sea, "
                f"and found {site.find} there.",
            )
        lines += ["", f"Day {day}. " + " ".join(sentences)]
    lines += ["", f"The expedition left {island} on day {DAYS + 1}."]
    return "\n".join(lines), team, sites, island


def question_and_answer(rng: random.Random, team: list[Member], sites: list[Site], island: str) -> tuple[str, str]:
    """A question about the report and its answer, from one of three kinds."""
    kind = rng.choice(["findings", "finder", "team"])
    if kind == "findings":
        visits = " ".join(
            f"On day {s.day} {s.finder.name}, the {s.finder.role}, led the team to {s.name}, {s.metres} metres "
            f"above the sea, where they found {s.find}."
            for s in sites
        )
        return (
            f"Summarise, in the order they happened, every site the team visited on {island} and what was found there.",
            f"The team visited {len(sites)} sites on {island}. {visits}",
        )
    if kind == "finder":
        site = rng.choice(sites)
        member = site.finder
        return (
            f"Who found {site.find}, where was it found, and when had that person joined the society?",
            f"{site.find[0].upper()}{site.find[1:]} was found by {member.name}, the expedition's {member.role}, at "
            f"{site.name} on day {site.day}. {member.name} had joined the society in {member.joined}.",
        )
    members = " ".join(f"{m.name} was the {m.role} and joined in {m.joined}." for m in team)
    return (
        f"List every member of the expedition to {island} with their role and the year they joined the society.",
        f"The expedition had {len(team)} members. {members}",
    )


def make_records(count: int = 40, seed: int = 0) -> list[dict[str, str]]:
    """``count`` LongAlpaca-format records (``instruction``, ``output``, ``file``)."""
    rng = random.Random(seed)
    records = []
    for index in range(count):
        text, team, sites, island = report(rng, index)
        question, answer = question_and_answer(rng, team, sites, island)
        instruction = (
            "Below is a field report. Read it carefully and answer the question that follows it.\n\n"
            f"{text}\n\nEnd of the report.\n\nQuestion: {question}"
        )
        records.append({"instruction": instruction, "output": answer, "file": f"report_{index:03d}.txt"})
    return records


def train_tokenizer(records: list[dict[str, str]], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on the records (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [text for record in records for text in (record["instruction"], record["output"])]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=1 << 20,
    )


def write_sample(out: Path, count: int = 40, seed: int = 0) -> None:
    """Write ``sample.json`` and ``sample_tokenizer/`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    records = make_records(count, seed)
    (out / SAMPLE_FILE).write_text(json.dumps(records, indent=1) + "\n")
    train_tokenizer(records).save_pretrained(out / TOKENIZER_DIR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=LONGALPACA_DIR, help=f"directory to write into (default: {LONGALPACA_DIR})"
    )
    parser.add_argument("--count", type=int, default=40, help="records (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_sample(args.out, args.count, args.seed)
    print(f"wrote {args.out / SAMPLE_FILE} and {args.out / TOKENIZER_DIR}/")


if __name__ == "__main__":
    main()
