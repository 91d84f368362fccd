"""The `long` suite (edgespec/bench/suites/long.jsonl): structured prompts with long inputs
(600-1800 tokens of context: a knowledge base to answer from, records to extract from, a module to
test, a contract to summarise). Deterministic (seeded), so the shipped file can be regenerated and
reviewed: `python -m edgespec.bench.suites_long` (tests/bench/test_suite_generators.py checks
that it reproduces the shipped file)."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "suites" / "long.jsonl"
SEED = 7

FIRST = ["Ana", "Ben", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Yusuf"]
LAST = ["Silva", "Okafor", "Novak", "Haddad", "Tanaka", "Berg", "Moreau", "Kowalski", "Rossi", "Nguyen",
        "Fischer", "Costa", "Ahmed", "Larsen", "Petrov", "Garcia"]
DEPTS = ["Sales", "Research", "Operations", "Finance", "Support", "Legal"]
CITIES = ["Lisbon", "Lagos", "Osaka", "Berlin", "Austin", "Oslo", "Porto", "Seoul", "Madrid", "Denver"]
PRODUCTS = ["router", "thermostat", "camera", "speaker", "scanner", "projector", "tablet", "monitor", "drone",
            "printer"]


def person(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def knowledge_base(r: random.Random, n: int) -> str:
    lines = []
    for i in range(n):
        p = r.choice(PRODUCTS)
        model = f"{p[:2].upper()}-{r.randint(100, 999)}"
        lines.append(
            f"Article {i + 1}: The {p} model {model} ships with firmware {r.randint(1, 9)}.{r.randint(0, 20)}, "
            f"draws {r.randint(3, 60)} W, and carries a {r.choice([1, 2, 3, 5])}-year warranty. To reset it, hold "
            f"the {r.choice(['power', 'mode', 'reset', 'menu'])} button for {r.randint(3, 15)} seconds. Support "
            f"tickets about it are answered within {r.choice([4, 8, 24, 48])} hours in {r.choice(CITIES)}.")
    return "\n".join(lines)


def records(r: random.Random, n: int) -> str:
    rows = []
    for i in range(n):
        rows.append(f"Employee #{1000 + i}: name={person(r)}, dept={r.choice(DEPTS)}, city={r.choice(CITIES)}, "
                    f"start=20{r.randint(10, 25):02d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}, "
                    f"salary={r.randrange(38000, 150000, 250)}")
    return "\n".join(rows)


def module(n: int) -> str:
    ops = [("add", "a + b"), ("sub", "a - b"), ("mul", "a * b"), ("clamp", "max(lo, min(hi, a))"),
           ("mean", "sum(xs) / len(xs)"), ("span", "max(xs) - min(xs)")]
    out = ['"""Small numeric helpers used by the billing service."""', "", "from __future__ import annotations", ""]
    for i in range(n):
        name, body = ops[i % len(ops)]
        fn = f"{name}_{i}"
        if "xs" in body:
            out += [f"def {fn}(xs: list[float]) -> float:",
                    f'    """Return the {name} of the values in xs (xs must not be empty)."""',
                    "    if not xs:", f'        raise ValueError("{fn} needs at least one value")', f"    return {body}", "", ""]
        elif "lo" in body:
            out += [f"def {fn}(a: float, lo: float, hi: float) -> float:",
                    '    """Clamp a into [lo, hi]."""', "    if lo > hi:",
                    f'        raise ValueError("{fn}: lo must not exceed hi")', f"    return {body}", "", ""]
        else:
            out += [f"def {fn}(a: float, b: float) -> float:", f'    """Return {body}."""', f"    return {body}", "", ""]
    return "\n".join(out)


CLAUSES = [
    "The Supplier shall deliver the Goods to the Customer's premises in {city} within {n} days of each purchase order.",
    "The Customer shall pay each undisputed invoice within {n} days of receipt, by bank transfer in euros.",
    "Either party may terminate this Agreement for convenience on {n} days' written notice to the other party.",
    ("The Supplier's total liability under this Agreement shall not exceed {n} percent of the fees paid in the "
    "twelve months preceding the claim, except for liability that cannot be limited by law."),
    ("Each party shall keep the other party's Confidential Information secret for {n} years after termination and "
    "use it only to perform this Agreement."),
    ("The Supplier warrants that the Goods will conform to the Specification for {n} months from delivery and shall, "
    "at its option, repair or replace non-conforming Goods."),
    ("Neither party shall be liable for delay caused by events beyond its reasonable control, provided it notifies "
    "the other party within {n} days and uses reasonable efforts to mitigate."),
    "The Customer may audit the Supplier's compliance with this Agreement once per year on {n} business days' notice.",
    "This Agreement is governed by the laws of {city}, and the courts of {city} have exclusive jurisdiction.",
    "The Supplier shall maintain product liability insurance of at least {n} million euros during the term.",
    "Any amendment to this Agreement must be in writing and signed by authorised representatives of both parties.",
    ("The Supplier shall not subcontract any obligation without the Customer's prior written consent, which shall "
    "not be unreasonably withheld, and remains responsible for its subcontractors."),
]


def contract(r: random.Random, n: int) -> str:
    a, b = person(r), person(r)
    head = (f"SUPPLY AGREEMENT between {a}, trading as {r.choice(LAST)} Components (the Supplier), and {b}, on behalf "
            f"of {r.choice(LAST)} Retail (the Customer).")
    body = [f"{i + 1}. " + r.choice(CLAUSES).format(n=r.randint(2, 90), city=r.choice(CITIES)) for i in range(n)]
    return head + "\n" + "\n".join(body)


def lines() -> list[dict]:
    """The suite's JSON lines, in order."""
    r = random.Random(SEED)
    prompts = [
        ("long-rag-1", "long-rag", (f"Context:\n{knowledge_base(r, 28)}\n\nQuestion: Which articles describe a camera, and "
                                   "what warranty and reset procedure does each have? Answer from the context only.")),
        ("long-rag-2", "long-rag", (f"Context:\n{knowledge_base(r, 36)}\n\nQuestion: List every product that draws more than "
                                   "40 W, with its model and firmware, as a bullet list.")),
        ("long-rag-3", "long-rag", (f"Context:\n{knowledge_base(r, 22)}\n\nQuestion: Summarise how support tickets are "
                                   "handled for the routers in the context, citing article numbers.")),
        ("long-json-1", "long-json", ("From the records below, extract the employees of the Research department as a "
                                     f"JSON list of objects with fields name, city, start and salary.\n{records(r, 40)}")),
        ("long-json-2", "long-json", ("Return a JSON object mapping each city to the list of employee numbers based "
                                     f"there, using only these records:\n{records(r, 32)}")),
        ("long-json-3", "long-json", ("Extract every employee who started in 2020 or later as JSON lines with keys "
                                     f"id, name and dept.\n{records(r, 45)}")),
        ("long-code-1", "long-code", (f"Here is a Python module:\n```python\n{module(12)}\n```\nWrite pytest unit tests "
                                     "for the first four functions, including the error cases.")),
        ("long-code-2", "long-code", (f"Here is a Python module:\n```python\n{module(16)}\n```\nRewrite clamp_3 and "
                                     "mean_4 with full docstrings that include doctest examples.")),
        ("long-code-3", "long-code", (f"Review this module and list each function with a one-line description:\n"
                                     f"```python\n{module(10)}\n```")),
        ("long-legal-1", "long-legal", (f"{contract(r, 14)}\n\nSummarise the Supplier's obligations under this agreement "
                                       "as a numbered list, keeping every time limit.")),
        ("long-legal-2", "long-legal", (f"{contract(r, 18)}\n\nRewrite clauses 1 to 5 in plain English, keeping every "
                                       "number and condition.")),
        ("long-legal-3", "long-legal", (f"{contract(r, 12)}\n\nWhich clauses limit or exclude a party's liability? Quote "
                                       "them and explain each in one sentence.")),
    ]
    return [{"id": pid, "category": cat, "prompt": text} for pid, cat, text in prompts]


def main(out: Path = OUT) -> None:
    rows = lines()
    out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {out}")


if __name__ == "__main__":
    main()
