"""The built-in training tasks, each a seeded generator of one record from training essays.

Long-context retrieval teaches SPEED's decode tokens to find what the shallow prompt holds;
continuation and short instructions keep its decode distribution close to the model's own.

- needle: one planted fact (eight kinds of fact, several wordings, sometimes with distractor
  facts of the same kind) and a question about it,
- passkey: a number to remember, hidden in long text,
- kv: a lookup among many keys (a JSON object of UUIDs, codes scattered through text, or
  every value one key is given),
- vartrack: a chain of variable assignments scattered through text (RULER's variable tracking),
- multiquery: several keys asked at once, every value answered in the order asked,
- wordfreq: counting over many spans: a long list or run of words in which a few recur more
  often than the rest, and the question which recur most, most frequent first,
- strings: a value no vocabulary word spells (a UUID, a hex code, a run of random letters),
  planted in text, sometimes among distractors, and asked for: it must be copied token by token,
- codedfreq: wordfreq over made-up letter strings, so the frequent words must be copied too,
- toplist: a numbered list in which ten words recur more often than the rest, all ten asked
  for (numbered wordfreq lists under about 2,300 tokens ask for three or five),
- continue: raw essay text; the prompt is its beginning, the response the next tokens,
- instruct: short instructions, alone or about a passage, answered later by the base model
  itself at full depth (self-distillation), so short-prompt behaviour is kept.

Every record is a dict: chat records have `messages` (the last one the assistant's, whose
content is None for instruct records until the base model answers), raw records `prompt` and
`response`. `kind` says which task made it. The text comes from the `TextSource` given,
whose corpus is the training split of Python's documentation by default: no evaluation
haystack (essays, RULER's text) is ever trained on.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable

from speedkv.prompts.builders import TextSource
from speedkv.prompts.haystack import plant, sentences


def _items(text: str) -> tuple[str, ...]:
    """A word list written compactly: comma-separated, or space-separated if no comma."""
    return tuple(item.strip() for item in text.split("," if "," in text else None))


FIRST_NAMES = _items(
    "Alice Bruno Chen Dmitri Elena Farid Grace Hiro Ingrid Jamal Keiko Liam Mara Nikolai Olga "
    "Pablo Quinn Rosa Sanjay Tomas Uma Viktor Wendy Ximena Yusuf Zoe Amara Bjorn Carmen Dario "
    "Esther Felix Greta Hassan Irene Jonas Kofi Lucia Mateo Nadia"
)
CITIES = _items(
    "Lisbon,Nairobi,Osaka,Toronto,Krakow,Lima,Hanoi,Oslo,Cairo,Denver,Porto,Seville,Tbilisi,"
    "Melbourne,Bergen,Quito,Dakar,Tallinn,Auckland,Glasgow,Valencia,Marseille,Bologna,Zagreb,"
    "Montreal,Santiago,Accra,Busan,Reykjavik,Ljubljana"
)
COLOURS = _items(
    "crimson,teal,amber,violet,olive,turquoise,magenta,ochre,indigo,coral,lavender,maroon,"
    "saffron,emerald,silver,charcoal"
)
OBJECTS = _items(
    "silver key,old map,blue notebook,brass compass,wooden box,spare battery,red envelope,"
    "glass marble,pocket watch,train ticket,small lantern,leather wallet"
)
PLACES = _items(
    "garden shed,attic,kitchen drawer,piano bench,blue vase,coat pocket,wine cellar,bookshelf,"
    "flower pot,toolbox,laundry basket,car trunk"
)
ANIMALS = _items("dog,cat,parrot,horse,rabbit,turtle,goat,hamster,goldfish,ferret")
PET_NAMES = _items(
    "Pepper,Maple,Ziggy,Noodle,Clover,Pixel,Mango,Juniper,Waffles,Basil,Tofu,Comet,Hazel,"
    "Marble,Pickle,Rusty"
)
JOBS = _items(
    "carpenter,pharmacist,pilot,baker,architect,librarian,veterinarian,translator,geologist,"
    "firefighter,jeweller,florist,surveyor,chemist,photographer"
)
WORDS = _items(
    "falcon,harbor,lantern,meadow,orchid,pebble,quartz,river,saddle,thunder,violin,willow,"
    "anchor,biscuit,canyon,dolphin,ember,fjord,glacier,hammock,igloo,jasmine,kettle,lemon,"
    "marble,nectar,oyster,pepper,quill,rocket,summit,tulip,umbrella,velvet,walnut,yarrow,"
    "zephyr,acorn,bramble,cobalt"
)
EVENTS = _items(
    "board meeting,school concert,charity run,book fair,science fair,team dinner,wedding,"
    "product launch,town festival,chess tournament"
)
MONTHS = _items(
    "January February March April May June July August September October November December"
)

# Each kind: fact wordings, question wordings, the answer sentence, the short answer.
NEEDLES: dict[str, dict[str, tuple[str, ...] | str]] = {
    "code": {
        "facts": (
            "The secret code for {word} is {num}.",
            "Remember this: the code word {word} goes with the number {num}.",
            "For the record, the access code for {word} is {num}.",
        ),
        "questions": (
            "What is the secret code for {word}?",
            "Which number goes with the code word {word}?",
            "What is the code for {word}?",
        ),
        "answer": "The code for {word} is {num}.",
        "short": "{num}",
    },
    "magic": {
        "facts": ("One of the special magic numbers for {word} is: {num}.",),
        "questions": (
            "What is the special magic number for {word} mentioned in the provided text?",
            "Which special magic number is given for {word}?",
        ),
        "answer": "The special magic number for {word} is {num}.",
        "short": "{num}",
    },
    "city": {
        "facts": (
            "{name} lives in {city}.",
            "{name} moved to {city} years ago and has lived there ever since.",
            "These days {name} calls {city} home.",
        ),
        "questions": (
            "Where does {name} live?",
            "In which city does {name} live?",
            "What city is {name}'s home?",
        ),
        "answer": "{name} lives in {city}.",
        "short": "{city}",
    },
    "colour": {
        "facts": (
            "{name}'s favourite colour is {colour}.",
            "Of all colours, {name} likes {colour} best.",
        ),
        "questions": (
            "What is {name}'s favourite colour?",
            "Which colour does {name} like best?",
        ),
        "answer": "{name}'s favourite colour is {colour}.",
        "short": "{colour}",
    },
    "hidden": {
        "facts": (
            "The {obj} is hidden in the {place}.",
            "Someone put the {obj} in the {place} for safekeeping.",
        ),
        "questions": ("Where is the {obj} hidden?", "Where can the {obj} be found?"),
        "answer": "The {obj} is in the {place}.",
        "short": "In the {place}",
    },
    "pet": {
        "facts": (
            "{name} has a {animal} named {pet}.",
            "The name of {name}'s {animal} is {pet}.",
        ),
        "questions": (
            "What is the name of {name}'s {animal}?",
            "What is {name}'s {animal} called?",
        ),
        "answer": "{name}'s {animal} is named {pet}.",
        "short": "{pet}",
    },
    "job": {
        "facts": ("{name} works as a {job}.", "By profession, {name} is a {job}."),
        "questions": ("What does {name} do for a living?", "What is {name}'s job?"),
        "answer": "{name} works as a {job}.",
        "short": "A {job}",
    },
    "date": {
        "facts": (
            "The {event} is scheduled for {month} {day}.",
            "Everyone should note that the {event} will take place on {month} {day}.",
        ),
        "questions": ("When is the {event} scheduled?", "On what date is the {event}?"),
        "answer": "The {event} is scheduled for {month} {day}.",
        "short": "{month} {day}",
    },
}

QUESTION_LEADS = ("", "According to the text above, ", "Based on the document, ", "From the text: ")
SHORT_SUFFIX = " Answer in a few words."

PASSKEY_FACTS = (
    "The pass key is {num}. Remember it. {num} is the pass key.",
    "Important: the passkey is {num}. Keep it in mind.",
    "The password to remember is {num}.",
)
PASSKEY_QUESTIONS = (
    "What is the pass key?",
    "What is the passkey mentioned in the text?",
    "What is the password hidden in the text above?",
)

STANDALONE = (
    "Name three rivers in Europe.",
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn.",
    "What is 17 plus 25?",
    "Give me a synonym for 'happy'.",
    "Translate 'good morning' into French.",
    "What is the capital of Japan?",
    "List four fruits that are red.",
    "How many days are there in a leap year?",
    "Write one sentence describing the ocean.",
    "What is the opposite of 'ancient'?",
    "Name two planets closer to the Sun than Earth.",
    "What does a thermometer measure?",
    "Give a short definition of photosynthesis.",
    "Suggest a name for a friendly robot.",
    "What colour do you get by mixing blue and yellow?",
    "Spell the word 'necessary' backwards.",
    "Who wrote Romeo and Juliet?",
    "Write a polite sentence declining an invitation.",
    "What is the boiling point of water in Celsius?",
)
FORMS = ("poem of four lines", "short story of three sentences", "limerick", "motivational note")
TOPICS = (
    "a lighthouse",
    "the first day of spring",
    "a lost umbrella",
    "a city at night",
    "learning to ride a bicycle",
    "a cup of tea",
    "mountains",
    "a rainy Monday",
)
CONCEPTS = (
    "gravity",
    "inflation",
    "a vaccine",
    "an algorithm",
    "democracy",
    "a black hole",
    "compound interest",
    "evolution",
    "a volcano",
    "the internet",
)
ACTIVITIES = (
    "sleeping better",
    "learning a language",
    "saving money",
    "studying for an exam",
    "staying focused",
    "cooking for friends",
    "running a first marathon",
)
PASSAGE_TASKS = (
    "Summarize the text above in two sentences.",
    "What is the main point of this passage?",
    "Suggest a title for this text.",
    "List three key ideas from the passage.",
    "Explain the first sentence of the passage in simple words.",
    "What question is the author trying to answer?",
    "Does the author sound optimistic or pessimistic? Explain briefly.",
)


# -- helpers ------------------------------------------------------------------------------------
def _number(rng: random.Random, digits: int | None = None) -> str:
    digits = digits or rng.choice((4, 5, 5, 6, 7))
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _values(rng: random.Random) -> dict[str, str]:
    """One random filling of every placeholder any needle uses."""
    return {
        "word": rng.choice(WORDS),
        "num": _number(rng),
        "name": rng.choice(FIRST_NAMES),
        "city": rng.choice(CITIES),
        "colour": rng.choice(COLOURS),
        "obj": rng.choice(OBJECTS),
        "place": rng.choice(PLACES),
        "animal": rng.choice(ANIMALS),
        "pet": rng.choice(PET_NAMES),
        "job": rng.choice(JOBS),
        "event": rng.choice(EVENTS),
        "month": rng.choice(MONTHS),
        "day": str(rng.randint(1, 28)),
    }


def _subject(kind: str, values: dict[str, str]) -> str:
    """What identifies a fact of this kind (distractors must differ in it)."""
    key = {"code": "word", "magic": "word", "hidden": "obj", "date": "event"}.get(kind, "name")
    return values[key]


def _layout(rng: random.Random, document: str, question: str) -> str:
    style = rng.random()
    if style < 0.6:
        return f"{document}\n\n{question}"
    if style < 0.8:
        return (
            "Read the following text and answer the question at the end.\n\n"
            f"{document}\n\nQuestion: {question}"
        )
    return f"{question}\n\n{document}\n\n{question}"


def _chat(kind: str, prompt: str, answer: str | None) -> dict:
    return {
        "kind": kind,
        "messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": answer},
        ],
    }


def _planted(rng: random.Random, text: str, facts: list[str]) -> str:
    """Plant facts at random depths, keeping their order of appearance random too."""
    for fact in facts:
        text = plant(text, fact, rng.random())
    return text


# -- the tasks ----------------------------------------------------------------------------------
def needle(rng: random.Random, source: TextSource, budget: int) -> dict:
    kind = rng.choice(sorted(NEEDLES))
    spec = NEEDLES[kind]
    target = _values(rng)
    facts = [rng.choice(spec["facts"]).format(**target)]
    if rng.random() < 0.5:  # distractors: same kind, other subjects and answers
        subjects = {_subject(kind, target)}
        for _ in range(rng.randint(1, 4)):
            other = _values(rng)
            if _subject(kind, other) not in subjects:
                subjects.add(_subject(kind, other))
                facts.append(rng.choice(spec["facts"]).format(**other))
    short = rng.random() < 0.2
    question = rng.choice(QUESTION_LEADS) + rng.choice(spec["questions"]).format(**target)
    question = question[0].upper() + question[1:]
    answer = (spec["short"] if short else spec["answer"]).format(**target)
    overhead = source.tokens(" ".join(facts) + question) + 40
    document = _planted(rng, source.text(rng, budget - overhead), facts)
    return _chat(
        "needle", _layout(rng, document, question + (SHORT_SUFFIX if short else "")), answer
    )


def passkey(rng: random.Random, source: TextSource, budget: int) -> dict:
    num = _number(rng)
    fact = rng.choice(PASSKEY_FACTS).format(num=num)
    question = rng.choice(PASSKEY_QUESTIONS)
    document = plant(source.text(rng, budget - 80), fact, rng.random())
    answer = rng.choice((f"The pass key is {num}.", num))
    return _chat("passkey", _layout(rng, document, question), answer)


def kv(rng: random.Random, source: TextSource, budget: int) -> dict:
    """A lookup among many keys: a JSON object, codes scattered through text, or every value
    one key has."""
    style = rng.random()
    if style < 0.35:
        return _kv_json(rng, source, budget)
    if style < 0.6:
        return _multivalue(rng, source, budget)
    words = rng.sample(WORDS, rng.randint(3, 10))
    codes = {w: _number(rng) for w in words}
    word = rng.choice(words)
    facts = [f"The code for {w} is {codes[w]}." for w in words]
    overhead = source.tokens(" ".join(facts)) + 60
    document = _planted(rng, source.text(rng, budget - overhead), facts)
    question = f"Several codes appear in the text. What is the code for {word}?"
    return _chat("kv", _layout(rng, document, question), f"The code for {word} is {codes[word]}.")


def _multivalue(rng: random.Random, source: TextSource, budget: int) -> dict:
    word = rng.choice(WORDS)
    numbers = [_number(rng) for _ in range(rng.randint(2, 4))]
    facts = [f"One of the special magic numbers for {word} is: {n}." for n in numbers]
    overhead = source.tokens(" ".join(facts)) + 60
    text = source.text(rng, budget - overhead)
    parts = sentences(text)
    spots = sorted(rng.randrange(len(parts) + 1) for _ in facts)
    for offset, (spot, fact) in enumerate(zip(spots, facts)):
        parts.insert(spot + offset, fact)  # the answer lists them in order of appearance
    question = f"What are all the special magic numbers for {word} mentioned in the text?"
    answer = f"The special magic numbers for {word} are: {', '.join(numbers)}."
    return _chat("kv", _layout(rng, " ".join(parts), question), answer)


def _kv_json(rng: random.Random, source: TextSource, budget: int) -> dict:
    def key() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    per_pair = source.tokens(json.dumps({key(): key()})) - 1
    pairs = {key(): key() for _ in range(max(2, (budget - 80) // per_pair))}
    wanted = rng.choice(list(pairs))
    prompt = (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n"
        f'{json.dumps(pairs, indent=0)}\n\nKey: "{wanted}"\n'
        "The value associated with the specified key is:"
    )
    return _chat("kv", prompt, pairs[wanted])


def vartrack(rng: random.Random, source: TextSource, budget: int) -> dict:
    def name() -> str:
        return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))

    chains = []
    for _ in range(rng.randint(1, 2)):  # the asked chain, maybe a distractor chain
        names = [name() for _ in range(rng.randint(2, 5))]
        chains.append((_number(rng, 5), names))
    value, asked = chains[0]
    text = source.text(rng, budget - 60 - 8 * sum(len(n) for _, n in chains))
    parts = sentences(text)
    for number, names in chains:
        spots = sorted(rng.randrange(len(parts) + 1) for _ in names)
        statements = [f"VAR {names[0]} = {number}."] + [
            f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])
        ]
        for offset, (spot, statement) in enumerate(zip(spots, statements)):
            parts.insert(spot + offset, statement)  # later statements stay later
    question = f"Find all variables that are assigned the value {value} in the text above."
    answer = f"The variables assigned the value {value} are: {', '.join(asked)}."
    return _chat("vartrack", _layout(rng, " ".join(parts), question), answer)


def multiquery(rng: random.Random, source: TextSource, budget: int) -> dict:
    """Codes for several words scattered through text; two to four of them asked at once."""
    words = rng.sample(WORDS, rng.randint(4, 12))
    codes = {w: _number(rng) for w in words}
    asked = rng.sample(words, rng.randint(2, min(4, len(words))))
    facts = [f"The code for {w} is {codes[w]}." for w in words]
    overhead = source.tokens(" ".join(facts)) + 80
    document = _planted(rng, source.text(rng, budget - overhead), facts)
    question = f"What are the codes for {', '.join(asked[:-1])} and {asked[-1]}?"
    answer = " ".join(f"The code for {w} is {codes[w]}." for w in asked)
    return _chat("multiquery", _layout(rng, document, question), answer)


def wordfreq(rng: random.Random, source: TextSource, budget: int) -> dict:
    """A numbered list of words (or a plain run of them) in which `top` words recur more
    often than every other word; the answer names them from the most frequent down."""
    return _frequency_list(rng, _vocabulary(rng, source), budget, "wordfreq", item_tokens=1)


def _vocabulary(rng: random.Random, source: TextSource) -> list[str]:
    """The plain words of a stretch of training text, sorted (the list's order is seeded)."""
    words = {w.strip(".,;:()[]'\"`").lower() for w in source.text(rng, 20000).split()}
    return sorted(w for w in words if w.isalpha() and 3 <= len(w) <= 12)


def codedfreq(rng: random.Random, source: TextSource, budget: int) -> dict:
    """wordfreq over made-up lowercase strings, several tokens each: a decode token can only
    name a frequent one by copying it from the prompt."""
    vocabulary = sorted({_letters(rng, rng.randint(4, 7)) for _ in range(max(64, budget // 3))})
    return _frequency_list(rng, vocabulary, budget, "codedfreq", item_tokens=3)


def toplist(rng: random.Random, source: TextSource, budget: int) -> dict:
    """wordfreq as a numbered list with ten frequent words where it has room (five or three in
    short ones), all of them asked for. Decoding past a shallow prompt tends to name one word
    again and again; this asks for ten distinct ones, as RULER's common-word task does."""
    words = _vocabulary(rng, source)
    return _frequency_list(rng, words, budget, "toplist", item_tokens=1, numbered=True, most=True)


def _frequency_list(
    rng: random.Random,
    vocabulary: list[str],
    budget: int,
    kind: str,
    item_tokens: int,
    numbered: bool | None = None,
    most: bool = False,
) -> dict:
    """`most`: as many top words as the list holds (ten from about 1,300 tokens), letting them
    fill up to all of it rather than half."""
    rare_max = rng.randint(1, 3)  # how often a word outside the top may recur
    drawn = rng.random() < 0.5  # drawn even when fixed, so wordfreq's records stay as recorded
    numbered = drawn if numbered is None else numbered
    per_item = item_tokens + (4 if numbered else 1)  # tokens of "123. word\n" or of " word"
    slots = (budget - 120) // per_item
    # the top words' counts are distinct and above every other word's; they fill at most
    # half the list (all of it with `most`), so that other words surround them
    room = 1 if most else 2
    fits = [t for t in (3, 5, 10) if room * t * (rare_max + 2 * t) <= slots]
    top = max(fits or [3]) if most else rng.choice(fits or [3])
    counts = sorted(rng.sample(range(rare_max + 1, rare_max + 1 + 2 * top), top), reverse=True)
    bonus = max(0, slots // (8 * top) - counts[-1])  # long lists: the top words stand out
    counts = [c + bonus for c in counts]
    rng.shuffle(vocabulary)
    common, rare = vocabulary[:top], vocabulary[top:]
    items = [w for w, c in zip(common, counts) for _ in range(c)]
    for at, word in enumerate(rare):
        if len(items) >= slots and at >= 8:
            break
        items += [word] * rng.randint(1, rare_max)
    rng.shuffle(items)
    if numbered:
        body = "\n".join(f"{i}. {w}" for i, w in enumerate(items, 1))
        lead = "Below is a numbered list of words. Some of them appear more often than others."
    else:
        body = " ".join(items)
        lead = "Read the following run of words and keep track of how often each one occurs."
    question = f"Which {top} words appear most often above? List them, most frequent first."
    answer = f"The {top} most frequent words are: {', '.join(common)}."
    return _chat(kind, f"{lead}\n\n{body}\n\n{question}", answer)


STRING_FACTS = (
    "The access token for {word} is {value}.",
    "One of the secret identifiers for {word} is: {value}.",
    "Write this down, it is the serial for {word}: {value}.",
    "The checksum recorded for {word} was {value}.",
)
STRING_QUESTIONS = (
    "What is the access token for {word}?",
    "Which secret identifier is given for {word}?",
    "What serial is written down for {word}?",
    "Which checksum was recorded for {word}?",
)


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(count))


def _random_value(rng: random.Random) -> str:
    """A string the tokenizer splits into pieces that carry no meaning."""
    style = rng.random()
    if style < 0.4:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if style < 0.7:
        return "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(8, 16)))
    return "-".join(_letters(rng, rng.randint(4, 7)) for _ in range(rng.randint(1, 3)))


def strings(rng: random.Random, source: TextSource, budget: int) -> dict:
    """One random string to copy back exactly, sometimes among other words' strings."""
    form = rng.randrange(len(STRING_FACTS))
    words = rng.sample(WORDS, rng.randint(1, 5))
    values = {w: _random_value(rng) for w in words}
    facts = [STRING_FACTS[form].format(word=w, value=values[w]) for w in words]
    word = words[0]
    question = STRING_QUESTIONS[form].format(word=word)
    overhead = source.tokens(" ".join(facts) + question) + 60
    document = _planted(rng, source.text(rng, budget - overhead), facts)
    answer = rng.choice((facts[0], values[word]))
    return _chat("strings", _layout(rng, document, question), answer)


def continuation(rng: random.Random, source: TextSource, budget: int) -> dict:
    """Raw text: the response is the next 24..160 tokens, split at a sentence or mid-text
    (the first tokens after the prompt are where shallow prefill costs the most)."""
    tok = source.tokenizer
    response_len = rng.randint(24, min(160, max(24, budget // 4)))
    text = source.text(rng, budget + 8)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cut = max(16, len(ids) - response_len)
    if rng.random() < 0.5:  # split between sentences, the response starting a new one
        parts = sentences(text)
        prompt, count = [], 0
        for part in parts:
            n = source.tokens(" " + part)
            if prompt and count + n > cut:
                break
            prompt.append(part)
            count += n
        rest = parts[len(prompt) :] or parts[-1:]
        return {"kind": "continue", "prompt": " ".join(prompt), "response": " " + " ".join(rest)}
    return {
        "kind": "continue",
        "prompt": tok.decode(ids[:cut]),
        "response": tok.decode(ids[cut : cut + response_len]),
    }


def instruct(rng: random.Random, source: TextSource, budget: int) -> dict:
    """An instruction whose answer the base model will write (content None until then)."""
    style = rng.random()
    if style < 0.25:
        prompt = rng.choice(STANDALONE)
    elif style < 0.5:
        prompt = rng.choice(
            (
                f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}.",
                f"Explain what {rng.choice(CONCEPTS)} is in simple terms.",
                f"Give three tips for {rng.choice(ACTIVITIES)}.",
            )
        )
    else:
        passage = source.text(rng, rng.randint(60, max(60, min(budget - 200, 1500))))
        prompt = f"{passage}\n\n{rng.choice(PASSAGE_TASKS)}"
    return _chat("instruct", prompt, None)


TASKS: dict[str, Callable[[random.Random, TextSource, int], dict]] = {
    "needle": needle,
    "passkey": passkey,
    "kv": kv,
    "vartrack": vartrack,
    "multiquery": multiquery,
    "wordfreq": wordfreq,
    "strings": strings,
    "codedfreq": codedfreq,
    "toplist": toplist,
    "continue": continuation,
    "instruct": instruct,
}
