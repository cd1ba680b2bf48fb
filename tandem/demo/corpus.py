"""The demo corpus: seeded agent-style chats that reason in `<think>…</think>` and answer in JSON.

Every example is one user request (optionally with tools offered in the system turn) and one
assistant turn made of a short reasoning text, which mentions the values it uses, and a JSON
answer. Two answer kinds exist:

- a plain JSON object (extraction, arithmetic, unit conversion, classification), and
- a tool call, in the Llama-3.1-like format `{"name": "<tool name>", "arguments": {...}}`: the
  whole answer is that one JSON object, and `arguments` follows the tool's `parameters` schema.

Each `TaskFamily` carries the JSON schema (draft 2020-12) its answers follow; constrained
generation uses it and tests validate against it. Value pools (names, cities, products, ...)
are split: every fifth item is reserved for `split="heldout"`, so a model trained on
`split="train"` is evaluated on values it never saw. Output is a pure function of
(seed, split, families).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Split = Literal["train", "heldout"]
HELDOUT_EVERY = 5  # pool item i is held out iff i % HELDOUT_EVERY == 0

SYSTEM_PROMPT = "You are a helpful assistant. Think first, then answer with one JSON object."


@dataclass(frozen=True)
class Example:
    """One chat: `messages` (system?, user) -> reasoning + JSON `answer`."""

    family: str
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]] | None
    reasoning: str
    answer: dict[str, Any]

    @property
    def answer_text(self) -> str:
        """The answer as the assistant writes it: `json.dumps` with default separators."""
        return json.dumps(self.answer)

    def chat(self) -> list[dict[str, str]]:
        """`messages` plus the assistant turn (`reasoning_content` + `content`), for chat templates."""
        reply = {"role": "assistant", "reasoning_content": self.reasoning, "content": self.answer_text}
        return [*self.messages, reply]


@dataclass(frozen=True)
class TaskFamily:
    """A kind of request: its answer schema, the tool it calls (if any) and its generator."""

    name: str
    schema: dict[str, Any]
    tool: dict[str, Any] | None  # {"type": "function", "function": {...}} for tool-call families
    make: Callable[[random.Random, Pools], tuple[str, str, dict[str, Any]]]  # -> user, reasoning, answer


# ---------------------------------------------------------------------------------------------
# Value pools
# ---------------------------------------------------------------------------------------------

_POOLS: dict[str, list[str]] = {
    "first": "Alice Bob Carla David Elena Farid Grace Hugo Ines Jonas Keiko Liam Maya Noah Olga Pablo "
    "Quinn Rosa Samir Tara Umar Vera Wei Xenia Yusuf Zoe Amir Bianca Chen Dara Emil Fatima Goran Hana "
    "Ivan Julia Kofi Lena Marco Nadia".split(),
    "last": "Smith Garcia Muller Rossi Tanaka Silva Novak Kim Dubois Jensen Okafor Lopez Ivanova Brown "
    "Haddad Costa Nguyen Weber Patel Larsen Moreau Sato Fischer Khan Berg Romero Ali Young Park Horvat".split(),
    "city": "Paris Berlin Madrid Rome Lisbon Vienna Prague Warsaw Oslo Dublin Athens Cairo Nairobi Lagos "
    "Tokyo Seoul Beijing Delhi Mumbai Bangkok Jakarta Manila Sydney Auckland Toronto Chicago Boston Denver "
    "Seattle Austin Miami Lima Bogota Santiago Quito Havana Dakar Tunis Riga Zagreb".split(),
    "product": [
        "laptop",
        "desk lamp",
        "coffee mug",
        "backpack",
        "keyboard",
        "monitor",
        "water bottle",
        "notebook",
        "headphones",
        "phone case",
        "office chair",
        "bike helmet",
        "tea kettle",
        "yoga mat",
        "umbrella",
        "wall clock",
        "camera bag",
        "power bank",
        "desk fan",
        "blender",
        "toaster",
        "pillow",
        "mouse pad",
        "frying pan",
        "rain jacket",
    ],
    "event": [
        "team meeting",
        "dentist appointment",
        "project review",
        "lunch",
        "budget planning",
        "design sync",
        "birthday party",
        "job interview",
        "code review",
        "yoga class",
        "sales call",
        "doctor visit",
        "book club",
        "quarterly review",
        "training session",
    ],
    "topic": [
        "electric cars",
        "healthy breakfast ideas",
        "python tutorials",
        "cheap flights",
        "solar panels",
        "marathon training",
        "sourdough bread",
        "home workouts",
        "remote jobs",
        "chess openings",
        "indoor plants",
        "budget travel",
        "learning spanish",
        "vintage cameras",
        "camping gear",
        "climate news",
        "jazz history",
        "board games",
        "meal prep",
        "night sky photos",
    ],
    "domain": "mail.com example.org inbox.net post.io webmail.com corp.dev".split(),
}
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR"]
UNITS = {  # (from, to): factor, so that result = value * factor
    ("km", "m"): 1000,
    ("m", "cm"): 100,
    ("kg", "g"): 1000,
    ("h", "min"): 60,
    ("min", "s"): 60,
    ("l", "ml"): 1000,
    ("m", "mm"): 1000,
    ("day", "h"): 24,
}
SENTIMENTS = {
    "positive": ["loved", "really enjoyed", "was delighted with", "am very happy with", "would recommend"],
    "negative": ["hated", "was disappointed by", "regret buying", "am unhappy with", "would not recommend"],
    "neutral": ["received", "tried", "used", "looked at", "have"],
}
TICKETS = {
    "billing": ["I was charged twice for", "my invoice is wrong for", "I need a refund for"],
    "technical": ["the app crashes when I open", "I get an error when I use", "I cannot log in to check"],
    "shipping": ["my package has not arrived with", "the delivery is late for", "tracking shows nothing for"],
    "account": ["I want to change my email for", "please delete my account linked to", "I forgot my password for"],
}
URGENCY = {
    "low": ["when you have time", "no rush"],
    "medium": ["soon please", "this week if possible"],
    "high": ["urgently", "right now, it is critical"],
}


class Pools:
    """The value pools of one split: train sees 4/5 of each list, heldout the other 1/5."""

    def __init__(self, split: Split):
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        keep = (lambda i: i % HELDOUT_EVERY != 0) if split == "train" else (lambda i: i % HELDOUT_EVERY == 0)
        self.items = {key: [v for i, v in enumerate(values) if keep(i)] for key, values in _POOLS.items()}

    def pick(self, rng: random.Random, key: str) -> str:
        return rng.choice(self.items[key])

    def person(self, rng: random.Random) -> str:
        return f"{self.pick(rng, 'first')} {self.pick(rng, 'last')}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return _object_schema({"name": {"const": function["name"]}, "arguments": function["parameters"]})


# ---------------------------------------------------------------------------------------------
# Families. Each generator returns (user text, reasoning text, answer object).
# ---------------------------------------------------------------------------------------------

WEATHER_TOOL = _tool(
    "get_weather",
    "Weather forecast for a city.",
    {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
)


def _weather(rng: random.Random, pools: Pools):
    city, unit, days = pools.pick(rng, "city"), rng.choice(["celsius", "fahrenheit"]), rng.randint(1, 7)
    span = _plural(days, "day")
    user = rng.choice(
        [
            f"What will the weather be in {city} over the next {span}? Use {unit}.",
            f"Give me a {days}-day forecast for {city} in {unit}.",
            f"Weather for {city}, {span}, in {unit} please.",
            f"I am travelling to {city}. How is the weather for {span}? I prefer {unit}.",
        ]
    )
    reasoning = rng.choice(
        [
            f"The user wants the weather in {city} for {span} in {unit}. The get_weather tool does this.",
            f"City is {city}, range is {span}, unit is {unit}. I will call get_weather.",
            f"I need a forecast for {city}. I call get_weather with days {days} and unit {unit}.",
        ]
    )
    return user, reasoning, {"name": "get_weather", "arguments": {"city": city, "unit": unit, "days": days}}


CURRENCY_TOOL = _tool(
    "convert_currency",
    "Convert an amount of money between currencies.",
    {
        "amount": {"type": "number", "minimum": 0},
        "from_currency": {"enum": CURRENCIES},
        "to_currency": {"enum": CURRENCIES},
    },
)


def _currency(rng: random.Random, pools: Pools):
    amount = rng.choice([rng.randint(1, 5000), round(rng.uniform(1, 999), 2)])
    source, target = rng.sample(CURRENCIES, 2)
    user = rng.choice(
        [
            f"How much is {amount} {source} in {target}?",
            f"Convert {amount} {source} to {target}.",
            f"I have {amount} {source}. What is that in {target}?",
        ]
    )
    reasoning = rng.choice(
        [
            f"The user wants to convert {amount} {source} into {target}. I will call convert_currency.",
            f"Amount {amount}, from {source}, to {target}. The convert_currency tool gives the rate.",
            f"I do not know today's rate from {source} to {target}, so I call convert_currency with {amount}.",
        ]
    )
    arguments = {"amount": amount, "from_currency": source, "to_currency": target}
    return user, reasoning, {"name": "convert_currency", "arguments": arguments}


CALENDAR_TOOL = _tool(
    "create_event",
    "Add an event to the calendar.",
    {
        "title": {"type": "string"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
)
MONTHS = "January February March April May June July August September October November December".split()


def _calendar(rng: random.Random, pools: Pools):
    title = pools.pick(rng, "event")
    year, month, day = rng.choice([2025, 2026]), rng.randint(1, 12), rng.randint(1, 28)
    hour, minute = rng.randint(7, 19), rng.choice([0, 15, 30, 45])
    people = sorted({pools.pick(rng, "first") for _ in range(rng.randint(0, 3))})
    date, time = f"{year}-{month:02d}-{day:02d}", f"{hour:02d}:{minute:02d}"
    spoken_date = f"{MONTHS[month - 1]} {day}, {year}"
    with_whom = f" with {' and '.join(people)}" if people else ""
    user = rng.choice(
        [
            f"Schedule a {title} on {spoken_date} at {time}{with_whom}.",
            f"Put {title} in my calendar for {spoken_date}, {time}{with_whom}.",
            f"Can you book a {title}{with_whom} on {spoken_date} at {time}?",
        ]
    )
    who = ", ".join(people) if people else "nobody else"
    reasoning = rng.choice(
        [
            f"The event is {title} on {spoken_date}, which is {date}, at {time}. "
            f"Attendees: {who}. I call create_event.",
            f"{spoken_date} means {date}. Time {time}. Invite {who}. The create_event tool adds it.",
        ]
    )
    arguments = {"title": title, "date": date, "time": time, "attendees": people}
    return user, reasoning, {"name": "create_event", "arguments": arguments}


SEARCH_TOOL = _tool(
    "web_search",
    "Search the web.",
    {
        "query": {"type": "string"},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
    },
)


def _search(rng: random.Random, pools: Pools):
    topic, count = pools.pick(rng, "topic"), rng.randint(1, 10)
    user = rng.choice(
        [
            f"Find me {_plural(count, 'result')} about {topic}.",
            f"Search the web for {topic}, top {count}.",
            f"Look up {topic} and show {count}.",
        ]
    )
    reasoning = rng.choice(
        [
            f"The user wants to search for {topic} and see {_plural(count, 'result')}. I call web_search.",
            f"This needs a web search. Query: {topic}. Maximum {count}.",
        ]
    )
    return user, reasoning, {"name": "web_search", "arguments": {"query": topic, "max_results": count}}


CONTACT_SCHEMA = _object_schema(
    {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]+$"},
    }
)


def _contact(rng: random.Random, pools: Pools):
    first, last = pools.pick(rng, "first"), pools.pick(rng, "last")
    name, age, city = f"{first} {last}", rng.randint(18, 90), pools.pick(rng, "city")
    email = f"{first.lower()}.{last.lower()}@{pools.pick(rng, 'domain')}"
    text = rng.choice(
        [
            f"{name} is {age} years old and lives in {city}. You can reach them at {email}.",
            f"Meet {name} ({age}), from {city}. Email: {email}.",
            f"Contact: {email}. {name}, age {age}, based in {city}.",
        ]
    )
    user = rng.choice(
        [
            f"Extract the contact details from this text: {text}",
            f"Turn this into JSON with name, age, city and email. {text}",
        ]
    )
    reasoning = rng.choice(
        [
            f"The name is {name}, the age is {age}, the city is {city} and the email is {email}.",
            f"I find {name}, aged {age}, in {city}, with email {email}.",
        ]
    )
    return user, reasoning, {"name": name, "age": age, "city": city, "email": email}


ORDER_SCHEMA = _object_schema(
    {
        "customer": {"type": "string"},
        "product": {"type": "string"},
        "quantity": {"type": "integer", "minimum": 1},
        "unit_price": {"type": "number", "minimum": 0},
    }
)


def _order(rng: random.Random, pools: Pools):
    customer, product = pools.person(rng), pools.pick(rng, "product")
    quantity, price = rng.randint(1, 20), round(rng.uniform(2, 300), 2)
    text = rng.choice(
        [
            f"{customer} ordered {quantity} x {product} at {price} each.",
            f"Order from {customer}: {_plural(quantity, product)}, unit price {price}.",
            f"{customer} wants to buy {quantity} of the {product} for {price} per item.",
        ]
    )
    user = rng.choice([f"Extract the order from: {text}", f"Parse this order into JSON. {text}"])
    reasoning = rng.choice(
        [
            f"The customer is {customer}. They want {quantity} of {product} at {price} per unit.",
            f"Customer {customer}, product {product}, quantity {quantity}, unit price {price}.",
        ]
    )
    return user, reasoning, {"customer": customer, "product": product, "quantity": quantity, "unit_price": price}


ARITHMETIC_SCHEMA = _object_schema({"expression": {"type": "string"}, "result": {"type": "integer"}})
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _arithmetic(rng: random.Random, pools: Pools):
    op = rng.choice(list(_OPS))
    a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 99), rng.randint(1, 99))
    expression, result = f"{a} {op} {b}", _OPS[op](a, b)
    user = rng.choice([f"What is {expression}?", f"Compute {expression}.", f"Calculate {expression} for me."])
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    reasoning = rng.choice([f"{a} {word} {b} is {result}.", f"I compute {expression} = {result}."])
    return user, reasoning, {"expression": expression, "result": result}


UNIT_NAMES = sorted({unit for pair in UNITS for unit in pair})
CONVERSION_SCHEMA = _object_schema(
    {
        "value": {"type": "number"},
        "from_unit": {"enum": UNIT_NAMES},
        "to_unit": {"enum": UNIT_NAMES},
        "result": {"type": "number"},
    }
)


def _conversion(rng: random.Random, pools: Pools):
    (source, target), factor = rng.choice(list(UNITS.items()))
    value = rng.randint(1, 50)
    result = value * factor
    user = rng.choice(
        [
            f"Convert {value} {source} to {target}.",
            f"How many {target} are in {value} {source}?",
            f"{value} {source} in {target}?",
        ]
    )
    reasoning = rng.choice(
        [
            f"1 {source} is {factor} {target}, so {value} {source} is {value} times {factor}, "
            f"which is {result} {target}.",
            f"There are {factor} {target} in 1 {source}. {value} x {factor} = {result}.",
        ]
    )
    return user, reasoning, {"value": value, "from_unit": source, "to_unit": target, "result": result}


SENTIMENT_SCHEMA = _object_schema({"label": {"enum": list(SENTIMENTS)}})


def _sentiment(rng: random.Random, pools: Pools):
    label = rng.choice(list(SENTIMENTS))
    phrase, product = rng.choice(SENTIMENTS[label]), pools.pick(rng, "product")
    review = f"I {phrase} the {product}."
    user = rng.choice(
        [f"Classify the sentiment of this review: {review}", f"Is this review positive, negative or neutral? {review}"]
    )
    reasoning = rng.choice(
        [f'The review says "{phrase}", which is {label}.', f'"I {phrase}" sounds {label} about the {product}.']
    )
    return user, reasoning, {"label": label}


TICKET_SCHEMA = _object_schema({"category": {"enum": list(TICKETS)}, "priority": {"enum": list(URGENCY)}})


def _ticket(rng: random.Random, pools: Pools):
    category, priority = rng.choice(list(TICKETS)), rng.choice(list(URGENCY))
    complaint, urgency = rng.choice(TICKETS[category]), rng.choice(URGENCY[priority])
    ticket = f"Hi, {complaint} my {pools.pick(rng, 'product')}. Please help {urgency}. {pools.person(rng)}"
    user = rng.choice(
        [f"Route this support ticket: {ticket}", f"Triage this ticket by category and priority. {ticket}"]
    )
    reasoning = rng.choice(
        [
            f'The customer says "{complaint}", so the category is {category}. "{urgency}" means {priority} priority.',
            f'This is a {category} issue with {priority} priority because they say "{urgency}".',
        ]
    )
    return user, reasoning, {"category": category, "priority": priority}


TOOLS = [WEATHER_TOOL, CURRENCY_TOOL, CALENDAR_TOOL, SEARCH_TOOL]
TASK_FAMILIES: dict[str, TaskFamily] = {
    family.name: family
    for family in [
        TaskFamily("weather", _tool_call_schema(WEATHER_TOOL), WEATHER_TOOL, _weather),
        TaskFamily("currency", _tool_call_schema(CURRENCY_TOOL), CURRENCY_TOOL, _currency),
        TaskFamily("calendar", _tool_call_schema(CALENDAR_TOOL), CALENDAR_TOOL, _calendar),
        TaskFamily("search", _tool_call_schema(SEARCH_TOOL), SEARCH_TOOL, _search),
        TaskFamily("contact", CONTACT_SCHEMA, None, _contact),
        TaskFamily("order", ORDER_SCHEMA, None, _order),
        TaskFamily("arithmetic", ARITHMETIC_SCHEMA, None, _arithmetic),
        TaskFamily("unit_conversion", CONVERSION_SCHEMA, None, _conversion),
        TaskFamily("sentiment", SENTIMENT_SCHEMA, None, _sentiment),
        TaskFamily("ticket", TICKET_SCHEMA, None, _ticket),
    ]
}


def make_example(family: TaskFamily, rng: random.Random, pools: Pools) -> Example:
    """One example of `family`. Tool families offer their tool alone or with one other, in random order."""
    user, reasoning, answer = family.make(rng, pools)
    tools = None
    if family.tool is not None:
        others = [tool for tool in TOOLS if tool is not family.tool]
        tools = [family.tool, *rng.sample(others, rng.randint(0, 1))]
        rng.shuffle(tools)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": user})
    return Example(family.name, messages, tools, reasoning, answer)


def iter_examples(seed: int, split: Split = "train", families: Sequence[str] | None = None) -> Iterator[Example]:
    """An endless, deterministic stream of examples; families are drawn uniformly."""
    names = list(TASK_FAMILIES) if families is None else list(families)
    unknown = sorted(set(names) - set(TASK_FAMILIES))
    if unknown or not names:
        raise ValueError(f"unknown task families {unknown or names}; known: {sorted(TASK_FAMILIES)}")
    rng, pools = random.Random(f"tandem-demo:{split}:{seed}"), Pools(split)
    while True:
        yield make_example(TASK_FAMILIES[rng.choice(names)], rng, pools)


def generate_examples(
    n: int, seed: int, split: Split = "train", families: Sequence[str] | None = None
) -> list[Example]:
    """The first `n` examples of `iter_examples(seed, split, families)`."""
    stream = iter_examples(seed, split, families)
    return [next(stream) for _ in range(n)]
