"""The `repetitive` suite (edgespec/bench/suites/repetitive.jsonl): repetitive intranet work run
as a stream of requests (`edgespec bench --suite repetitive --modes plain,auto,auto+suffix`):
templated invoice extraction, SQL over one schema, a ticket form, an agent loop re-emitting JSON
actions. The four kinds interleave (extraction, sql, form, agent, extraction, ...), each request a new record in the
same template, so the suffix cache learns the template while the stream runs. Deterministic:
`python -m edgespec.bench.suites_repetitive` rewrites the shipped file."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "suites" / "repetitive.jsonl"
N_PER_KIND = 30

VENDORS = ["Acme Tools GmbH", "Nordlicht Papier AG", "Bauer & Sohn KG", "Helix Labs Ltd", "Rivera Logistics SL",
           "Kowalski Print Sp. z o.o.", "Blue Fjord AS", "Ostara Foods BV", "Sato Electronics KK", "Moreau Textiles SA"]
ITEMS = ["toner cartridges", "office chairs", "network switches", "printer paper", "laptop docks", "safety gloves",
         "LED panels", "coffee beans", "USB cables", "desk lamps"]
CITIES = ["Berlin", "Hamburg", "Munich", "Cologne", "Vienna", "Zurich", "Lyon", "Milan", "Madrid", "Prague"]
COMPONENTS = ["printer", "VPN", "email", "laptop", "badge reader", "wifi", "phone", "shared drive", "monitor", "ERP"]
PROBLEMS = ["stopped working this morning", "is very slow since the update", "shows an error on start",
            "cannot be reached from floor 3", "asks for the password again and again", "drops the connection hourly"]
FILES = ["report.csv", "notes.txt", "budget.xlsx", "invoice.pdf", "data.json", "minutes.docx", "plan.md"]

SCHEMA = ("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);\n"
          "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), "
          "total REAL, created DATE);\n"
          "CREATE TABLE items (order_id INTEGER REFERENCES orders(id), product TEXT, quantity INTEGER, price REAL);")
QUESTIONS = [
    "the total of all orders of customers in {city}",
    "the number of orders per customer in {city}, largest first",
    "the names of customers in {city} who ordered {item}",
    "the average order total in {city} since {date}",
    "the ten largest orders placed after {date}",
    "how many {item} were ordered by customers in {city}",
]


def extraction(r: random.Random, i: int) -> str:
    vendor, item = r.choice(VENDORS), r.choice(ITEMS)
    number = f"INV-2024-{r.randint(100, 9999):04d}"
    day, month = r.randint(1, 28), r.choice(["January", "March", "May", "July", "September", "November"])
    qty, price = r.randint(2, 40), r.randint(5, 400) + r.choice([0, 0.5, 0.99])
    return (f"Extract the invoice as JSON with the keys invoice_number, date, vendor, item, quantity, unit_price, "
            f"total and currency. Answer with the JSON only.\n\nInvoice {number}, issued {day} {month} 2024 by "
            f"{vendor}: {qty} x {item} at {price:.2f} EUR each, total {qty * price:.2f} EUR.")


def sql(r: random.Random, i: int) -> str:
    q = r.choice(QUESTIONS).format(city=r.choice(CITIES), item=r.choice(ITEMS),
                                   date=f"2024-{r.randint(1, 12):02d}-01")
    return f"{SCHEMA}\n\nWrite one SQLite query for {q}. Answer with the SQL only."


def form(r: random.Random, i: int) -> str:
    comp, prob = r.choice(COMPONENTS), r.choice(PROBLEMS)
    who = r.choice(["Anna", "Jonas", "Mehmet", "Lena", "Piotr", "Sofia", "Ken", "Marie"])
    return (f"Fill in the support ticket template for this message, one line per field, nothing else:\n"
            f"Title:\nComponent:\nPriority (low/medium/high):\nReporter:\nSummary:\n\n"
            f"Message from {who}: the {comp} {prob}.")


def agent(r: random.Random, i: int) -> str:
    files = r.sample(FILES, 3)
    goal = r.choice(["find the budget total", "summarise the meeting minutes", "count the rows of the report",
                     "list the overdue invoices", "find the project deadline"])
    step = r.randint(1, 5)
    return (f"You are a file agent. Reply with the next action as one JSON object "
            f'{{"thought": "...", "action": "read_file" | "list_dir" | "finish", "args": {{"path": "..."}}}} '
            f"and nothing else.\nGoal: {goal}.\nStep {step}. Observation: the directory holds "
            f"{', '.join(files)}.")


def lines() -> list[dict]:
    """The suite's JSON lines, in order: the four kinds interleaved, N_PER_KIND of each."""
    r = random.Random(26)
    kinds = [("extraction", extraction), ("sql", sql), ("form", form), ("agent", agent)]
    return [{"id": f"{cat}-{i:02d}", "category": f"repetitive-{cat}", "prompt": fn(r, i)}
            for i in range(N_PER_KIND) for cat, fn in kinds]


def main(out: Path = OUT) -> None:
    rows = lines()
    out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()
