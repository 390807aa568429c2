"""A generated multi-hop knowledge base for an offline search-agent demo.

Fictional people, cities, countries and books, one fact per passage, so no model can answer from
memory and every question needs two searches:

* "In which country was <person> born?"         person -> birth city -> country
* "In which city was the author of <book> born?"  book -> author -> birth city

Everything derives from ``seed``; the held-out questions ask about people and books no training
question mentions.
"""

from __future__ import annotations

import random

ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z", "th"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
BOOK_NOUNS = ["Chronicle", "Letters", "Garden", "Tide", "Crown", "Bridge", "Song", "Winter"]
CODAS = ["", "n", "r", "l", "s", "th", "m", "k", "nd", "rk"]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))
    return w.capitalize()


def _names(rng: random.Random, count: int, make) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        name = make()
        if name.lower() not in seen:
            seen.add(name.lower())
            out.append(name)
    return out


def make_kb(seed: int = 0, people: int = 300, cities: int = 40, countries: int = 12, books: int = 200,
            eval_fraction: float = 0.2) -> dict[str, list[dict]]:
    """{'corpus': [{id, title, text}], 'train' / 'eval': two-hop questions, 'train_one_hop' /
    'eval_one_hop': one-hop questions about the same people and books; each question row is
    {id, question, answers, support}, ``support`` the titles of the passages that answer it, in order
    (for two hops the second is the bridge entity's passage)."""
    rng = random.Random(seed)
    words = _names(rng, countries + cities, lambda: _word(rng, rng.choice([2, 3])))
    country_names = [w + rng.choice(["ia", "land", "or", "ara"]) for w in words[:countries]]
    city_names = words[countries:]
    person_names = _names(rng, people, lambda: f"{_word(rng, 2)} {_word(rng, 2)}")
    book_names = _names(rng, books, lambda: f"The {_word(rng, 2)} {rng.choice(BOOK_NOUNS)}")
    city_country = {c: rng.choice(country_names) for c in city_names}
    born = {p: rng.choice(city_names) for p in person_names}
    author = {b: rng.choice(person_names) for b in book_names}
    corpus = []
    for c in city_names:
        corpus.append({"title": c, "text": f"{c} is a city in {city_country[c]}."})
    for p in person_names:
        corpus.append({"title": p, "text": f"{p} was born in {born[p]}."})
    for b in book_names:
        corpus.append({"title": b, "text": f"{b} is a novel written by {author[b]}."})
    rng.shuffle(corpus)
    for i, doc in enumerate(corpus):
        doc["id"] = f"kb-{i}"
    # Held-out people and books: the last ones of each list; a held-out book's author is never a
    # training person's question either way (the question names the book, not the author).
    n_eval_people, n_eval_books = int(people * eval_fraction), int(books * eval_fraction)
    questions = {"train": [], "eval": []}
    for i, p in enumerate(person_names):
        split = "eval" if i >= people - n_eval_people else "train"
        questions[split].append({"question": f"In which country was {p} born?", "answers": [city_country[born[p]]],
                                 "support": [p, born[p]]})
    for i, b in enumerate(book_names):
        split = "eval" if i >= books - n_eval_books else "train"
        questions[split].append({"question": f"In which city was the author of {b} born?",
                                 "answers": [born[author[b]]], "support": [b, author[b]]})
    # One-hop questions about the same people and books (the first passage holds the answer), for a
    # curriculum and for measuring the copying skill apart from the second search.
    one_hop = {"train": [], "eval": []}
    for i, p in enumerate(person_names):
        split = "eval" if i >= people - n_eval_people else "train"
        one_hop[split].append({"question": f"In which city was {p} born?", "answers": [born[p]], "support": [p]})
    for i, b in enumerate(book_names):
        split = "eval" if i >= books - n_eval_books else "train"
        one_hop[split].append({"question": f"Who wrote {b}?", "answers": [author[b]], "support": [b]})
    for split, rows in questions.items():
        random.Random(seed + (split == "eval")).shuffle(rows)
        for i, row in enumerate(rows):
            row["id"] = f"{split}-{i}"
    for split, rows in one_hop.items():
        random.Random(seed + 2 + (split == "eval")).shuffle(rows)
        for i, row in enumerate(rows):
            row["id"] = f"{split}-1hop-{i}"
    return {"corpus": corpus, **questions, "train_one_hop": one_hop["train"], "eval_one_hop": one_hop["eval"]}
