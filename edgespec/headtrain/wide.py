"""Wide prompts for self-distillation: the six categories built around real material (the
functions, paragraphs and licence texts shipped in installed packages) and around open lists
of everyday topics, so the head sees prompts as varied as a caller's, not a few templates.

The category prompts (prompts.py) are templates x small word lists: a head trained on them alone
agrees with the target far more often on their held-out siblings than on hand-written prompts
(docs/benchmarks/README.md, "EAGLE-3 head"). `wide_prompts(n, seed)` draws from:
- code: a real Python function (a `def` block of 4-30 lines) to explain, document, test, fix,
  shorten or translate;
- json: a real sentence or a function signature to turn into a JSON object or list;
- legal: a paragraph of a licence (LICENSE, COPYING) to explain, summarise or question;
- rag: a real documentation paragraph with a question over it;
- chat: an everyday topic (a long list) in one of many phrasings;
- chinese: 资料 sentences with slots filled and questions over them, and open questions on many
  topics.
Deterministic in `seed` for one set of installed packages (the project's pinned environment).
The benchmark suites' prompts (edgespec/bench/suites) are never produced.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

from edgespec.headtrain.data import package_files
from edgespec.headtrain.prompts import category_prompts, round_robin

_CODE_T = [
    "Explain what this Python function does:\n```python\n{code}\n```",
    "Write a docstring for this function:\n```python\n{code}\n```",
    "Write unit tests with pytest for this function:\n```python\n{code}\n```",
    "Is there a bug in this code? Explain.\n```python\n{code}\n```",
    "Rewrite this function in JavaScript:\n```python\n{code}\n```",
    "Add type hints to this function:\n```python\n{code}\n```",
    "Summarise this code in one sentence, then list its inputs and outputs.\n\n{code}",
    "How could this function be made faster or simpler?\n```python\n{code}\n```",
    "Review this code as a senior engineer would:\n{code}",
]
_JSON_T = [
    'Extract the main terms of this sentence as a JSON list of strings: "{s}"',
    'Return a JSON object with the fields subject, action and details for: "{s}"',
    'Convert this into a JSON object with keys "topic" and "summary": {s}',
    "Describe the parameters of this function as a JSON array of objects (name, meaning):\n{sig}",
    'Output only JSON. Classify the sentence (fields: category, sentiment, keywords): "{s}"',
    'Write a JSON object that records this statement with a title, a short description and tags: "{s}"',
]
_LEGAL_T = [
    'Explain this clause in plain English:\n"{p}"',
    "What does this licence text allow, and what does it require?\n\n{p}",
    "Summarise the obligations in the following text in three bullet points.\n\n{p}",
    "Read the clause and answer: who is protected by it, and how?\nClause: {p}",
    "Rewrite this paragraph so that a non-lawyer understands it:\n{p}",
    "List the conditions in this text, one per line.\n{p}",
]
_RAG_T = [
    "Context: {p}\nQuestion: What is this passage about?",
    "Answer using only the context.\nContext: {p}\nQuestion: What does the text say about {term}?",
    "Summarize the following text in two sentences:\n{p}",
    "Read the passage and list its three main points.\nPassage: {p}",
    "Based on the documentation below, how would a user {verb}?\n\n{p}",
    "Passage:\n{p}\n\nQ: Which terms does the passage define or name? Answer briefly.",
    "Use the passage to answer.\n{p}\nQuestion: Why does {term} matter here?",
]
_CHAT_TOPICS = """
staying focused at work;sleeping better;cooking for one;a first apartment;learning to swim;planning a holiday;
keeping a journal;starting to run;making friends in a new city;a tidy kitchen;growing tomatoes;a budget for
groceries;choosing a laptop;learning to draw;an old bicycle;talking to a difficult colleague;a long flight;
writing a cover letter;asking for a raise;a picnic;a rainy day with children;learning to code;a book club;
visiting grandparents;a home office;drinking more water;a morning routine;reducing screen time;a camping trip;
taking better photos with a phone;a small garden on a balcony;teaching a dog to sit;a school science project;
preparing for a presentation;writing a thank-you note;cleaning a fridge;choosing running shoes;a family dinner;
learning French;saving for a car;the first day at a new job;painting a room;a board game night;a city weekend;
a museum with teenagers;a healthy snack;stretching after exercise;meal planning;a quiet evening;a road trip playlist;
fixing a leaking tap;setting goals for the year;a birthday surprise;a job offer;moving house;volunteering;
learning the piano;keeping bees;bird watching;a winter coat;a hiking trail;a coffee shop;working night shifts;
a noisy neighbour;a lost wallet;renewing a passport;a wedding gift;a science fiction film;a history podcast;
stargazing;knitting;a chess club;a language exchange;a farmers market;fresh bread;a first aid kit;
a power cut;a slow internet connection;backing up photos;a strong password;an online course;a mentor;
giving feedback;a team meeting;a difficult decision;a shy child;a new puppy;an elderly parent;a job search;
a career change;public transport;a train journey;the ocean;mountains;deserts;rainforests;the moon;volcanoes;
earthquakes;the seasons;the history of bread;ancient Egypt;the printing press;the internet;electricity;
solar panels;recycling plastic;composting;fast fashion;local food;a small shop;a bakery;a library card
""".replace("\n", "").split(";")
_CHAT_T = [
    "What are some good ways to deal with {t}?", "Can you give me advice about {t}?", "Tell me about {t}.",
    "I need help with {t}. Where should I start?", "What should I know about {t}?",
    "Write a short paragraph about {t}.", "Give me three ideas for {t}.", "Explain {t} simply.",
    "What do people often get wrong about {t}?", "Write a friendly message to a colleague about {t}.",
    "Describe {t} in a few sentences.", "Make a short checklist for {t}.", "Why is {t} worth thinking about?",
    "Could you suggest a plan for {t}?", "Write a short dialogue between two friends about {t}.",
    "What questions should I ask about {t}?", "Share some fun facts about {t}.", "How would you explain {t} to a child?",
    "Write a haiku about {t}.", "Give me a short story that starts with {t}.",
]
_ZH_NAMES = ["张伟", "王芳", "李娜", "刘洋", "陈静", "杨磊", "赵敏", "黄强", "周杰", "吴丽", "徐涛", "孙悦"]
_ZH_PLACES = ["北京", "上海", "广州", "深圳", "杭州", "成都", "南京", "武汉", "西安", "苏州", "天津", "重庆"]
_ZH_ITEMS = ["笔记本电脑", "打印机", "办公椅", "投影仪", "显示器", "服务器", "软件许可证", "会议室", "工作手机", "门禁卡"]
_ZH_FACTS = [
    ("{n}负责{c}分公司的{i}采购，每月预算为{a}万元，超过预算需要总经理批准。",
     ["谁负责{i}采购？", "每月预算是多少？", "超过预算怎么办？"]),
    ("公司规定员工出差前须提交申请，{c}地区的住宿标准为每晚{a}元，交通费凭发票报销。",
     ["住宿标准是多少？", "交通费如何报销？"]),
    ("{i}的保修期为{k}年，保修期内免费维修，保修期外按实际费用收取。",
     ["保修期是多久？", "保修期外如何收费？"]),
    ("本季度{c}分公司的销售额为{a}万元，比上季度增长{k}%，主要来自新客户。",
     ["本季度销售额是多少？", "增长主要来自哪里？"]),
    ("客户数据每天凌晨{h}点备份，备份保留{a}天，恢复数据需要向信息部提交申请。",
     ["备份保留多少天？", "如何恢复数据？"]),
    ("{n}于{y}年加入公司，目前担任{c}办公室的技术经理，负责{k}个项目。",
     ["{n}什么时候加入公司？", "{n}现在担任什么职务？"]),
    ("员工每年有{k}天带薪病假，请病假超过两天需要提供医院证明。",
     ["每年有多少天病假？", "什么情况下需要医院证明？"]),
    ("会议改到星期{w}下午{h}点，地点在{c}办公室{k}号会议室，请{n}准备材料。",
     ["会议什么时候开？", "谁负责准备材料？"]),
    ("新员工入职第一周需要完成安全培训和{i}使用培训，培训由人事部安排。",
     ["新员工第一周要完成什么？", "培训由谁安排？"]),
    ("合同金额为{a}万元，分{k}期支付，每期在验收合格后{h}个工作日内付款。",
     ["合同金额是多少？", "分几期支付？", "什么时候付款？"]),
    ("系统密码每{k}个月必须更换一次，密码长度不少于{h}位，并包含字母和数字。",
     ["密码多久更换一次？", "密码有什么要求？"]),
    ("{c}仓库的{i}库存为{a}台，低于{k}台时系统会自动提醒采购部门。",
     ["库存有多少？", "什么时候会提醒采购部门？"]),
]
_ZH_QT = ["根据以下资料回答问题。资料：{ctx}问题：{q}", "资料：{ctx}\n请根据资料回答：{q}", "请阅读下面的内容并回答问题。\n{ctx}\n问题：{q}",
          "以下是公司通知：{ctx}请用一句话总结这条通知。", "根据资料：{ctx}请列出其中的关键信息。"]
_ZH_TOPICS = ["绿色出行", "垃圾分类", "网络安全", "团队合作", "时间管理", "客户服务", "健康生活", "节约用水", "读书习惯", "职业规划",
              "远程会议", "数据备份", "报销制度", "信息保密", "安全生产", "消防演练", "员工福利", "办公用品管理", "差旅安排",
              "项目验收", "合同管理", "发票管理", "年度总结", "新员工入职", "用电安全", "个人隐私", "电子邮件礼仪", "会议效率",
              "压力管理", "跑步锻炼", "中秋节", "春节假期", "城市交通", "人工智能", "智能手机", "在线学习", "旅游计划", "家庭理财"]
_ZH_OPEN = ["请简要介绍{t}。", "关于{t}，有哪些实用的建议？", "请写一段关于{t}的说明。", "{t}有什么好处？", "请用三句话介绍{t}。",
            "请为公司员工写一份关于{t}的提醒。", "如何做好{t}？请分点回答。", "请解释{t}的重要性。", "给我一个关于{t}的例子。",
            "请写一个关于{t}的简短通知。"]

_DEF = re.compile(r"^def [A-Za-z_]\w*\(.*?:\s*$", re.M)


def _functions(text: str) -> Iterable[str]:
    """Top-level `def` blocks of 4-30 lines (comments and docstrings as written)."""
    for m in _DEF.finditer(text):
        lines = text[m.start():].split("\n")
        body = [lines[0]]
        for ln in lines[1:]:
            if ln and not ln[0].isspace():
                break
            body.append(ln)
        while body and not body[-1].strip():
            body.pop()
        if 4 <= len(body) <= 30 and sum(len(b) for b in body) < 1500:
            yield "\n".join(body)


def _paragraphs(text: str) -> Iterable[str]:
    """Prose paragraphs of 25-160 words (no code, tables or markup lines)."""
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().split("\n")]
        if not lines or any(ln.startswith(("    ", ">>>", "..", "|", "+", "=", "-", "#", "*", "`", "{", "<")) for ln in lines):
            continue
        p = " ".join(lines)
        n = len(p.split())
        if 25 <= n <= 160 and p.count("(") < 6 and sum(c.isalpha() for c in p) > 0.7 * len(p):
            yield p


def _sentences(p: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", p) if 8 <= len(s.split()) <= 40]


def _material(seed: int, max_files: int) -> dict[str, list[str]]:
    """Functions, signatures, paragraphs, sentences and licence paragraphs of installed packages."""
    m: dict[str, list[str]] = {"code": [], "sig": [], "para": [], "sent": [], "licence": [], "term": []}
    for name, text in package_files(max_files=max_files, seed=seed):
        low = name.lower()
        if low.endswith(".py"):
            for f in _functions(text):
                m["code"].append(f)
                m["sig"].append(f.split("\n")[0])
            continue
        paras = list(_paragraphs(text))
        if "license" in low or "copying" in low or "licence" in low:
            m["licence"].extend(paras)
            continue
        m["para"].extend(paras)
        for p in paras:
            m["sent"].extend(_sentences(p))
            m["term"].extend(w.strip(".,;:()") for w in p.split() if w[:1].isupper() and len(w) > 4)
    return m


def wide_prompts(n: int, seed: int = 0, max_files: int = 6000, exclude: Iterable[str] = ()) -> list[tuple[str, str]]:
    """n distinct (category, prompt) pairs, the six categories round-robin, deterministic in
    `seed` for one set of installed packages; none in `exclude`."""
    rng = random.Random(f"wide:{seed}")
    m = _material(seed, max_files)
    for k in m:
        rng.shuffle(m[k])
    verbs = ["configure it", "get started", "avoid the common mistakes", "use this feature", "check the result"]

    def code() -> str:
        return rng.choice(_CODE_T).format(code=rng.choice(m["code"]))

    def json_() -> str:
        t = rng.choice(_JSON_T)
        return t.format(s=rng.choice(m["sent"]), sig=rng.choice(m["sig"]))

    def legal() -> str:
        return rng.choice(_LEGAL_T).format(p=rng.choice(m["licence"]))

    def rag() -> str:
        return rng.choice(_RAG_T).format(p=rng.choice(m["para"]), term=rng.choice(m["term"]), verb=rng.choice(verbs))

    def chat() -> str:
        return rng.choice(_CHAT_T).format(t=rng.choice(_CHAT_TOPICS).strip())

    def chinese() -> str:
        if rng.random() < 0.6:
            facts = rng.sample(_ZH_FACTS, rng.choice((1, 1, 2)))
            s = {"n": rng.choice(_ZH_NAMES), "c": rng.choice(_ZH_PLACES), "i": rng.choice(_ZH_ITEMS),
                 "a": rng.randint(2, 500), "k": rng.randint(2, 12), "h": rng.randint(1, 9), "y": rng.randint(2005, 2024),
                 "w": rng.choice("一二三四五")}
            ctx = "".join(f.format(**s) for f, _ in facts)
            return rng.choice(_ZH_QT).format(ctx=ctx, q=rng.choice(facts[0][1]).format(**s))
        return rng.choice(_ZH_OPEN).format(t=rng.choice(_ZH_TOPICS))

    gens = {"code": code, "json": json_, "legal": legal, "rag": rag, "chat": chat, "chinese": chinese}
    need = {"code": ("code",), "json": ("sent", "sig"), "legal": ("licence",), "rag": ("para", "term")}  # what each draws on
    return round_robin({c: g for c, g in gens.items() if all(m[k] for k in need.get(c, ()))}, n, set(exclude), tries=200)


def prompt_sources(heldout: int, distill: int, wide: int, seed: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """The training prompts by source, (shard-name prefix, (category, prompt) pairs): `heldout`
    + `distill` category prompts (prompts.py), and `heldout` + `wide` wide prompts when `wide` > 0,
    none of them a category prompt. The first `heldout` of each source are held
    out."""
    sources = [("", category_prompts(heldout + distill, seed))]
    if wide:
        sources.append(("wide-", wide_prompts(heldout + wide, seed, exclude=[p for _, p in sources[0][1]])))
    return sources
