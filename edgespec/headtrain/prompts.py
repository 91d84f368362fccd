"""Synthetic prompts for self-distillation, in the categories the appliance serves: code, JSON
extraction, legal clauses, RAG (a passage and a question), chat, Chinese.

Each category is templates x slots filled from small word lists, so a seed gives thousands of
distinct prompts offline; `category_prompts(n, seed)` interleaves the categories round-robin
(every prefix of the list is balanced) without repeating a prompt. The benchmark suites'
prompts (edgespec/bench/suites) are never generated verbatim.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

CATEGORIES = ("code", "json", "legal", "rag", "chat", "chinese")

_FUNCS = [
    ("reverse_words", "reverses the order of the words in a sentence"), ("is_prime", "checks whether n is prime"),
    ("flatten", "flattens a nested list"), ("chunk", "splits a list into chunks of size k"),
    ("merge_dicts", "merges two dictionaries, the second winning on conflicts"),
    ("word_freq", "counts how often each word appears in a text"), ("gcd", "computes the greatest common divisor"),
    ("binary_search", "finds an item in a sorted list"), ("dedupe", "removes duplicates while keeping order"),
    ("parse_date", "parses a date in YYYY-MM-DD format"), ("to_snake_case", "converts CamelCase to snake_case"),
    ("rotate_list", "rotates a list by k positions"), ("max_subarray", "returns the largest sum of a contiguous subarray"),
    ("validate_email", "checks whether a string looks like an email address"),
    ("celsius_to_fahrenheit", "converts a temperature"), ("median", "returns the median of a list of numbers"),
    ("transpose", "transposes a matrix given as a list of lists"), ("count_vowels", "counts the vowels in a string"),
    ("read_json", "loads a JSON file and returns its content"), ("retry", "retries a function up to n times"),
    ("anagrams", "groups words that are anagrams of each other"), ("running_mean", "returns the running mean of a list"),
    ("slugify", "turns a title into a URL slug"), ("top_k", "returns the k most common items"),
    ("matrix_multiply", "multiplies two matrices"), ("is_balanced", "checks whether brackets are balanced"),
    ("roman_to_int", "converts a Roman numeral to an integer"), ("lru_cache", "implements a tiny LRU cache"),
    ("file_size", "returns the size of a file in a human-readable form"), ("debounce", "debounces a callback"),
]
_LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "Bash", "SQL"]
_CODE_T = [
    "Write a {lang} function `{name}` that {does}.", "Implement `{name}` in {lang}: it {does}.",
    "Write a {lang} function that {does}, with a docstring and an example.",
    "Explain what a function that {does} should do, then write it in {lang}.",
    "Write unit tests in {lang} for a function `{name}` that {does}.",
    "Refactor this {lang} idea into clean code: a function `{name}` that {does}.",
    "Write a {lang} function `{name}` that {does}, and explain its time complexity.",
    "Show how to write a function that {does} in {lang}, step by step.",
]
_TABLES = [("users", "name, email, age"), ("orders", "id, user_id, total, created_at"), ("products", "sku, title, price"),
           ("employees", "name, department, salary"), ("invoices", "number, customer, amount, due_date"),
           ("events", "id, kind, timestamp"), ("books", "title, author, year")]
_SQL_T = ["Write a SQL query on table {t} ({c}) that returns the rows sorted by the first column.",
          "Write a SQL query that counts the rows of table {t} ({c}) grouped by its second column.",
          "Write a SQL query that selects the columns {c} from {t} with a filter and a limit of 10."]

_PEOPLE = ["Anna Lee", "Carlos Ruiz", "Mei Chen", "Tom Becker", "Fatima Khan", "John Miller", "Sara Rossi", "Lukas Novak",
           "Priya Patel", "Olga Ivanova", "Kenji Sato", "Emma Dubois", "Ahmed Ali", "Laura Smith", "Diego Gomez"]
_CITIES = ["Berlin", "Lisbon", "Toronto", "Osaka", "Nairobi", "Lyon", "Austin", "Krakow", "Seoul", "Porto", "Denver",
           "Milan", "Oslo", "Dublin", "Sydney"]
_ITEMS = ["laptop", "office chair", "printer paper", "train ticket", "hotel room", "software licence", "conference pass",
          "monitor", "coffee machine", "phone plan", "bicycle", "desk lamp"]
_JSON_T = [
    'Extract name, city and amount as JSON from: "{p} from {c} paid {a} dollars for a {i}."',
    'Return a JSON object with the fields customer, item and price for: "{p} bought a {i} for {a} euros in {c}."',
    'Convert to JSON with keys name, age and city: "{p} is {n} years old and lives in {c}."',
    'Give a JSON array of two objects (name, city) for: "{p} lives in {c}; {q} lives in {d}."',
    'Extract as JSON (product, quantity, unit_price): "Order: {n} x {i} at {a} each."',
    "Write a JSON object describing a {i} with the fields name, price, in_stock and tags.",
    'Produce JSON with keys event, date and location for: "{p} will host a workshop in {c} on {n} March."',
    "Write a JSON config for a web server in {c} with host, port, debug and allowed_origins.",
    'Parse into JSON (from, to, subject): "Email from {p} to {q} about the {i} order."',
    "Create a JSON schema for an object with a name (string), an age (integer) and an email (string).",
]

_PARTIES = [("the Tenant", "the Landlord"), ("the Employee", "the Company"), ("the Supplier", "the Buyer"),
            ("the Licensee", "the Licensor"), ("the Contractor", "the Client"), ("the Borrower", "the Lender"),
            ("the Seller", "the Purchaser"), ("the Consultant", "the Customer")]
_LEGAL_TOPICS = ["confidentiality", "termination", "limitation of liability", "indemnification", "force majeure",
                 "governing law", "payment terms", "intellectual property", "non-compete", "warranty",
                 "data protection", "assignment", "dispute resolution", "notices", "severability", "insurance"]
_LEGAL_T = [
    "Write a short {topic} clause for an agreement between {a} and {b}.",
    "Explain in plain English what a {topic} clause means for {a}.",
    'Continue this clause: "{A} shall not, without the prior written consent of {b},"',
    'Rewrite in plain English: "{A} shall be solely responsible for all {topic} obligations arising hereunder."',
    "List three risks for {a} in a {topic} clause and how to reduce them.",
    'Continue this contract clause about {topic}: "In the event that {a} fails to"',
    "Draft a {topic} section for a contract in which {a} provides services to {b}.",
    "Summarise the purpose of a {topic} clause in two sentences.",
]

_FACTS = [
    ("The library opens at {h} am and closes at {k} pm on weekdays. On Saturdays it closes at noon.",
     ["When does the library close on Saturdays?", "What are the weekday opening hours?"]),
    ("The {i} costs {a} dollars and comes with a {n}-year warranty. Shipping to {c} takes five days.",
     ["How long is the warranty?", "How much does the {i} cost and how long is shipping?"]),
    ("{p} joined the company in {y} as an engineer and became head of the {c} office in {z}.",
     ["When did {p} join the company?", "Which office does {p} lead, and since when?"]),
    ("Refunds are issued within {n} days of receiving the returned {i}. Items must be unused.",
     ["How long do refunds take?", "What condition must returned items be in?"]),
    ("The train from {c} to {d} leaves at {h}:15 and takes {n} hours. A return ticket costs {a} euros.",
     ["When does the train leave and how long is the trip?", "How much is a return ticket?"]),
    ("Our API allows {a} requests per minute per key. Exceeding the limit returns HTTP status 429.",
     ["What is the rate limit?", "What happens when the limit is exceeded?"]),
    ("The meeting with {p} is moved from Monday to Thursday at {h} pm in room {n}.",
     ["When is the meeting now?", "Where will the meeting take place?"]),
    ("{c} has about {a} thousand inhabitants and is known for its old harbour and its university, founded in {y}.",
     ["How many people live in {c}?", "When was the university founded?"]),
    ("Employees may work from home {n} days a week. Requests go to the manager by email one week in advance.",
     ["How many days can employees work from home?", "How are requests made?"]),
    ("Backups run every night at {h} am and are kept for {a} days. Restores are requested through the help desk.",
     ["How long are backups kept?", "How can a restore be requested?"]),
]
_RAG_T = ["Context: {ctx}\nQuestion: {q}", "Answer using only the context.\nContext: {ctx}\nQuestion: {q}",
          "Read the passage and answer.\nPassage: {ctx}\nQ: {q}", "Context:\n{ctx}\n\nBased on the context, {ql}"]

_CHAT_TOPICS = ["a vegetable garden", "public speaking", "saving money", "a first marathon", "learning the guitar",
                "moving to a new city", "a rainy weekend", "houseplants", "a job interview", "remote work",
                "a road trip", "baking bread", "a dog that barks", "studying for exams", "a healthy lunch",
                "time management", "a birthday gift", "the night sky", "photography", "a small business",
                "recycling", "meditation", "writing a novel", "a museum visit", "climbing", "the ocean",
                "volcanoes", "the history of tea", "electric cars", "chess", "a wedding speech", "jet lag"]
_CHAT_T = ["Can you give me some tips about {t}?", "Explain {t} to a ten-year-old.", "Write a short story about {t}.",
           "What are the pros and cons of {t}?", "Write a friendly email to a friend about {t}.",
           "List five interesting facts about {t}.", "How do I get started with {t}?",
           "Write a short poem about {t}.", "What mistakes do beginners make with {t}?",
           "Describe {t} in three sentences.", "Give me a plan for a week focused on {t}.",
           "Why do people enjoy {t}?"]

_ZH_TOPICS = ["年假制度", "报销流程", "数据安全", "客户投诉处理", "远程办公", "绩效考核", "信息保密", "合同审批",
              "新员工培训", "网络钓鱼", "个人信息保护", "会议纪要", "项目管理", "反洗钱", "采购流程", "加班规定",
              "健康饮食", "时间管理", "学习英语", "环境保护", "人工智能", "云计算", "密码管理", "供应链"]
_ZH_T = ["请简单介绍一下{t}。", "请列出关于{t}的三个要点。", "请用通俗的语言解释{t}。", "关于{t}，员工需要注意什么？",
         "请写一段关于{t}的通知。", "{t}有哪些常见的问题？请举例说明。", "请为{t}写一个简短的总结。",
         "根据以下资料回答问题。资料：公司的{t}规定每季度检查一次，由部门经理负责。问题：谁负责{t}的检查？",
         "请把下面的句子翻译成中文：Please follow the rules about {e}.", "请给出改进{t}的五条建议。"]
_ZH_EN = ["data security", "expense reports", "remote work", "customer privacy", "password changes", "meeting rooms"]


def _code(rng: random.Random) -> str:
    if rng.random() < 0.15:
        t, c = rng.choice(_TABLES)
        return rng.choice(_SQL_T).format(t=t, c=c)
    name, does = rng.choice(_FUNCS)
    return rng.choice(_CODE_T).format(lang=rng.choice(_LANGS), name=name, does=does)


def _json(rng: random.Random) -> str:
    p, q = rng.sample(_PEOPLE, 2)
    c, d = rng.sample(_CITIES, 2)
    return rng.choice(_JSON_T).format(p=p, q=q, c=c, d=d, i=rng.choice(_ITEMS), a=rng.randint(5, 2000), n=rng.randint(2, 60))


def _legal(rng: random.Random) -> str:
    a, b = rng.choice(_PARTIES)
    if rng.random() < 0.5:
        a, b = b, a
    return rng.choice(_LEGAL_T).format(topic=rng.choice(_LEGAL_TOPICS), a=a, b=b, A=a[0].upper() + a[1:])


def _rag(rng: random.Random) -> str:
    facts = rng.sample(_FACTS, rng.choice((1, 1, 2)))
    slots = {"p": rng.choice(_PEOPLE), "c": rng.choice(_CITIES), "d": rng.choice(_CITIES), "i": rng.choice(_ITEMS),
             "a": rng.randint(10, 900), "n": rng.randint(2, 9), "h": rng.randint(6, 11), "k": rng.randint(5, 9),
             "y": rng.randint(1950, 2020), "z": rng.randint(2021, 2025)}
    ctx = " ".join(f.format(**slots) for f, _ in facts)
    q = rng.choice(facts[0][1]).format(**slots)
    return rng.choice(_RAG_T).format(ctx=ctx, q=q, ql=q[0].lower() + q[1:])


def _chat(rng: random.Random) -> str:
    return rng.choice(_CHAT_T).format(t=rng.choice(_CHAT_TOPICS))


def _chinese(rng: random.Random) -> str:
    return rng.choice(_ZH_T).format(t=rng.choice(_ZH_TOPICS), e=rng.choice(_ZH_EN))


_GEN = {"code": _code, "json": _json, "legal": _legal, "rag": _rag, "chat": _chat, "chinese": _chinese}


def category_prompts(n: int, seed: int = 0, categories=CATEGORIES) -> list[tuple[str, str]]:
    """n distinct (category, prompt) pairs, categories round-robin, deterministic in `seed`."""
    from pathlib import Path

    suites = Path(__file__).resolve().parent.parent / "bench" / "suites"
    seen = set()
    for f in suites.glob("*.jsonl") if suites.is_dir() else ():
        import json

        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                seen.add(json.loads(line).get("prompt", ""))
    rngs = {c: random.Random(f"{seed}:{c}") for c in categories}
    return round_robin({c: partial(_GEN[c], rngs[c]) for c in categories}, n, seen, tries=2000)


def round_robin(gens: dict[str, Callable[[], str]], n: int, seen: set[str], tries: int) -> list[tuple[str, str]]:
    """n distinct (category, prompt) pairs, one from each generator in turn (every prefix is
    balanced), none in `seen` (which grows); a generator that draws only seen prompts `tries`
    times in a row has run out and drops out."""
    live = list(gens)
    out: list[tuple[str, str]] = []
    while len(out) < n and live:
        for c in list(live):
            if len(out) >= n:
                break
            for _ in range(tries):
                p = gens[c]()
                if p not in seen:
                    break
            else:
                live.remove(c)
                continue
            seen.add(p)
            out.append((c, p))
    return out
