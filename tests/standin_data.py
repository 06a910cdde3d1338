"""Stand-ins, built by the tests, for the data megapar may not ship (tests/data/SOURCE.md, "Not shipped").

Every expected count comes from the construction (each submission says which step drops it and why), never from
running the code under test: a fresh clone checks the same properties as the real files do.

* ``write_pushshift_dumps``: two monthly Pushshift submission dumps (``RS_v2_<yyyy-mm>.xz``, xz-compressed JSON
  lines with the fields the URL stage reads, plus a few others real dumps carry), whose URLs hit every
  extract/dedup/blacklist rule.
* ``trunc63_documents``: web-like documents of 63 GPT-2 tokens cut from the shipped corpora (as the WebText
  trunc63 splits were made: encode, keep the first 63 tokens, decode), with exact duplicates.
* ``NON_ENGLISH``: short German, French and Spanish texts written for these tests.
"""
from __future__ import annotations

import functools
import json
import lzma
from dataclasses import dataclass
from pathlib import Path

import pytest

from data_dirs import GPT2_DIR, SHIPPED


@dataclass(frozen=True)
class Sub:
    """One submission and its fate: ``extract`` (jcpeterson's rules, "kept" or the removal reason), ``dedup``
    (cross-month, for extracted URLs: "kept" or "duplicate") and ``megatron`` (Megatron's blacklist on the URL
    alone: None or the reason; exact-string duplicates of kept URLs come on top). ``raw`` is the line when it is
    not a JSON record of this submission."""
    url: str | None
    score: object = 10
    over_18: bool = False
    extract: str = "kept"
    dedup: str = "kept"
    megatron: str | None = None
    raw: str | None = None


def _clean(month: str, k: int, **kw) -> Sub:
    return Sub(f"http://www.dailynews{month.replace('-', '')}x{k}.com/{month}/story-{k}.html", **kw)


def _june() -> list[Sub]:
    subs = [_clean("2005-06", k) for k in range(20)]
    subs += [
        _clean("2005-06", 100, score=3),  # score >= 3 is kept
        _clean("2005-06", 101, score=2, extract="low_karma"),
        _clean("2005-06", 102, score=0, extract="low_karma"),
        _clean("2005-06", 103, score=-4, extract="low_karma"),
        _clean("2005-06", 104, over_18=True, extract="over_18"),
        Sub("http://imgur.com/gallery/abc", extract="domain", megatron="domain"),
        Sub("http://i.imgur.com/abc", extract="domain", megatron="domain"),
        Sub("http://www.youtube.com/watch?v=abc123", extract="domain", megatron="domain"),
        Sub("http://en.wikipedia.org/wiki/Web_page", extract="domain", megatron="domain"),
        Sub("http://www.example-photos.com/holiday.jpg", extract="extension", megatron="extension"),
        Sub("http://www.example-papers.com/paper.PDF", extract="extension", megatron="extension"),
        Sub("http://ab", extract="short", megatron="malformed"),  # 9 chars: short for jcpeterson (< 10), not for
        Sub("http://a", extract="short", megatron="short"),  # Megatron (<= 8), whose URL regex wants a dot
        Sub("http://www.spaced.com/a b", extract="whitespace"),
        Sub(None, score=5, extract="missing_field"),
        Sub("http://www.noscore.com/page.html", score="7", extract="missing_field"),
        Sub(None, extract="bad_json", raw='{"url": "http://www.broken.com/", "score": 1'),
        Sub(None, extract="bad_json", raw="[1, 2, 3]"),
        # kept by jcpeterson, dropped by Megatron's blacklist
        Sub("http://maps.google.co.uk/maps?q=london", megatron="domain"),
        Sub("http://someone.tumblr.com/post/1", megatron="domain"),
        Sub("http://www.example-sheets.com/report.xls", megatron="extension"),
        Sub("http://a.b", megatron="malformed"),  # 10 chars, so not short; a one-letter TLD
        Sub("http://localhost/page.html", megatron="malformed"),
        Sub("http://my_host.com/story.html", megatron="malformed"),
        # kept here; July repeats them in another spelling
        Sub("http://www.querynews.com/article?a=1&amp;b=2"),
        Sub("http://www.casenews.com/2005/06/story.html"),
        Sub("http://www.samenews.com/2005/06/story.html"),
    ]
    return subs


def _july() -> list[Sub]:
    subs = [_clean("2005-07", k) for k in range(180)]
    subs += [
        Sub("http://www.querynews.com/article?b=2&a=1", dedup="duplicate"),  # parameter order, &amp;
        Sub("http://WWW.CASENEWS.COM/2005/06/story.html", dedup="duplicate"),  # host case
        Sub("http://www.samenews.com/2005/06/story.html", dedup="duplicate"),  # the same string
        _clean("2005-07", 5, dedup="duplicate"),  # twice in one month
        Sub("http://www.dropbox.com/s/abc/notes.html", megatron="domain"),
        Sub("http://www.example-sheets.com/data.xlsx", megatron="extension"),
        Sub("http://www.example-art.com/logo.ai", extract="extension", megatron="extension"),  # fused '.7z.ai'
        _clean("2005-07", 200, score=1, extract="low_karma"),
        _clean("2005-07", 201, over_18=True, extract="over_18"),
        Sub("http://www.reddit.com/r/news/comments/abc", extract="domain", megatron="domain"),
        Sub("http://x.com/clip.gifv?x=1", extract="extension", megatron="extension"),
    ]
    return subs


MONTHS = {"2005-06": _june, "2005-07": _july}


def submissions() -> dict[str, list[Sub]]:
    """{month: its submissions in dump order}."""
    return {month: make() for month, make in MONTHS.items()}


def record(sub: Sub, month: str, n: int) -> str:
    """The dump line of one submission: the fields extract_urls reads and some that real dumps also carry."""
    if sub.raw is not None:
        return sub.raw
    rec = {"id": f"{month[-2:]}{n:05x}", "created_utc": 1117584000 + 3600 * n, "subreddit": "reddit.com",
           "author": f"user{n % 17}", "title": f"Submission {n}", "num_comments": n % 7, "is_self": False,
           "over_18": sub.over_18, "url": sub.url, "score": sub.score,
           "permalink": f"/r/reddit.com/comments/{n:x}/"}
    return json.dumps(rec)


def write_pushshift_dumps(folder: Path) -> Path:
    """RS_v2_2005-06.xz and RS_v2_2005-07.xz in ``folder`` (created); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for month, subs in submissions().items():
        lines = "".join(record(s, month, n) + "\n" for n, s in enumerate(subs))
        (folder / f"RS_v2_{month}.xz").write_bytes(lzma.compress(lines.encode("utf-8")))
    return folder


def raw_urls() -> list[str]:
    """The ``url`` field of every record that has a one-line string URL, in dump order (the unfiltered list)."""
    return [s.url for subs in submissions().values() for s in subs
            if s.raw is None and isinstance(s.url, str) and " " not in s.url]


def expected_counts() -> dict:
    """What each URL step reports on the stand-in dumps, from the fates in the construction."""
    subs = [s for month in submissions().values() for s in month]
    extract: dict = {"submissions": len(subs), "dumps_done": len(MONTHS)}
    for s in subs:
        key = "kept" if s.extract == "kept" else f"removed:{s.extract}"
        extract[key] = extract.get(key, 0) + 1
    extracted = [s for s in subs if s.extract == "kept"]
    unique = [s for s in extracted if s.dedup == "kept"]
    dedup = {"urls": len(extracted), "kept": len(unique), "removed:duplicate": len(extracted) - len(unique)}
    blacklist: dict = {"urls": len(unique)}
    for s in unique:
        key = "kept" if s.megatron is None else f"removed:{s.megatron}"
        blacklist[key] = blacklist.get(key, 0) + 1
    # Megatron on the unfiltered list: each rule as constructed, then exact-string repeats of passing URLs.
    by_url = {s.url: s for s in subs if isinstance(s.url, str)}
    raw: dict = {"urls": 0}
    seen: set[str] = set()
    for url in raw_urls():
        reason = by_url[url].megatron
        if reason is None and url in seen:
            reason = "duplicate"
        seen.add(url)
        raw["urls"] += 1
        key = "kept" if reason is None else f"removed:{reason}"
        raw[key] = raw.get(key, 0) + 1
    return {"extract": extract, "dedup": dedup, "blacklist": blacklist, "blacklist_raw": raw,
            "june_kept": sum(s.extract == "kept" for s in submissions()["2005-06"])}


@functools.cache
def reference_gpt2():
    """GPT-2's encoding as tiktoken builds it from the shipped BPE files with its own loader and its own copy of
    GPT-2's pre-tokenizer pattern (no megapar code involved)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # read the files as they are; write no cache
        ranks = data_gym_to_mergeable_bpe_ranks(str(GPT2_DIR / "vocab.bpe"), str(GPT2_DIR / "encoder.json"))
    return tiktoken.Encoding("gpt2-reference", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def corpus_documents() -> list[str]:
    """The shipped corpora cut into documents: the WebText samples, Emma's paragraphs, Shakespeare's speeches."""
    corpora = SHIPPED / "corpora"
    docs = [p.read_text() for p in sorted((corpora / "webtext_gpt2_sample").glob("*.txt"))]
    for path in (corpora / "gutenberg_emma" / "austen-emma.txt", corpora / "tinyshakespeare" / "input.txt"):
        docs += [p for p in path.read_text().split("\n\n") if p.strip()]
    return docs


def trunc63_documents(encoding, sources: tuple[str, ...] = ("webtext", "emma", "shakespeare")) -> list[str]:
    """Documents of exactly 63 GPT-2 tokens, made as the WebText trunc63 splits were (documents of >= 63
    tokens, each cut to its first 63 and decoded; cuts that do not re-encode to 63 tokens are left out), from
    the shipped corpora named in ``sources``; then exact copies of the 2nd and the middle document at the end."""
    corpora = SHIPPED / "corpora"
    texts = {"webtext": [p.read_text() for p in sorted((corpora / "webtext_gpt2_sample").glob("*.txt"))],
             "emma": (corpora / "gutenberg_emma" / "austen-emma.txt").read_text().split("\n\n"),
             "shakespeare": (corpora / "tinyshakespeare" / "input.txt").read_text().split("\n\n")}
    docs = []
    for name in sources:
        for text in texts[name]:
            ids = encoding.encode_ordinary(text)
            cut = encoding.decode(ids[:63])
            if len(ids) >= 63 and len(encoding.encode_ordinary(cut)) == 63:
                docs.append(cut)
    return docs + [docs[1], docs[len(docs) // 2]]


# Short texts in German, French and Spanish written for these tests (a few sentences each, as a web page's
# opening might read).
NON_ENGLISH = [
    "Der kleine Hund lief jeden Morgen mit seinem Besitzer durch den Park. Danach tranken sie zusammen Kaffee in "
    "der Bäckerei an der Ecke, und der Hund bekam immer ein Stück Brot.",
    "Die Stadtverwaltung hat heute beschlossen, die alte Brücke über den Fluss im nächsten Jahr zu erneuern. Die "
    "Bauarbeiten sollen im Frühling beginnen und ungefähr acht Monate dauern.",
    "Le petit chat dormait sur la fenêtre pendant que la pluie tombait doucement sur la ville. Sa maîtresse "
    "préparait le dîner et écoutait la radio dans la cuisine.",
    "Le conseil municipal a décidé de construire une nouvelle bibliothèque près de l'école. Les travaux "
    "commenceront au printemps et les habitants pourront donner leur avis.",
    "El tren llegó tarde a la estación porque había nieve en las montañas. Los viajeros esperaron dos horas en el "
    "andén, pero nadie se quejó porque el paisaje era muy bonito.",
    "Mi abuela cocina la mejor paella del pueblo. Todos los domingos la familia se reúne en su casa para comer "
    "juntos y hablar de las noticias de la semana.",
]
