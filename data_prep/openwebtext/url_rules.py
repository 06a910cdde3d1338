"""URL rules shared by extract_urls (jcpeterson ``is_bad_url``) and blacklist_urls (Megatron).

Domain lookups use ``tldextract`` with its bundled public-suffix snapshot only (``suffix_list_urls=()``),
so results are offline and reproducible.
"""
from __future__ import annotations

import functools
import re
from urllib.parse import urlsplit

import tldextract

# jcpeterson url_utils.py: full domain or base domain (domain.suffix) in this list -> bad.
JCP_BAD_DOMAINS = frozenset("""
imgur.com redd.it gfycat.com giphy.com reddituploads.com redditmedia.com twimg.com sli.mg magaimg.net flickr.com
imgflip.com youtube.com youtu.be youtubedoubler.com vimeo.com twitch.tv streamable.com bandcamp.com soundcloud.com
video.google.com instagram.com deviantart.com itunes.apple.com pornhub.com pinterest.com erome.com flic.kr reddit.com
gyazo.com github.com xkcd.com twitter.com spotify.com facebook.com gunprime.com strawpoll.me voyagefusion.com
rollingstone.com google.com timeanddate.com walmart.com roanoke.com spotrac.com discord.gg ebay.com hotdealstar.com
edealinfo.com aapks.com dlapkandroid.org wikipedia.org battleforthenet.com""".split())

JCP_BAD_EXTENSIONS = tuple("""
.png .jpg .jpeg .gif .gifv .pdf .mp4 .mp3 .ogv .webm .doc .docx .log .csv .dat .iso .bin .exe .apk .jar .app .ppt .pps
.pptx .xml .gz .xz .bz2 .tgz .tar .zip .wma .mov .wmv .3gp .svg .swf .avi .css .mid .midi .mpg .mpeg .mkv .qt .ram .rar
.tiff .txt .wav .aif .ogg .7z .deb .tar.gz .pkg .dmg .sql .py .otf .ttf .bmp .ai .psd .js""".split())

# Megatron blacklist_urls.py: tldextract registrable label (no subdomain, no suffix) in this set -> "domain".
MEGATRON_BAD_LABELS = frozenset("""
500px aapks akamaihd amazon apple artifactfire artstation awwni bandcamp battleforthenet coinscalendar dailymotion
deviantart discord discordapp dlapkandroid dropbox e621 ebay edealinfo erome eroshare explosm facebook fbcdn flickr
furaffinity futhead gatopardo gfycat gifsound gifsoup giphy github google gunprime gyazo horsefucker hotdealstar
imagefap imageshack imgflip imgur instagram karmadecay kryptocal kym-cdn liveleak livememe lmgtfy magaimg
memegenerator minorplanetcenter minus mobafire morejpeg nocookie pcpartpicker photobucket pinimg pinterest pixiv
pornhub prntscr puu qkme quickmeme radd redd reddit reddit-stream redditlog redditmedia reddituploads redtube reupp
reverb roanoke rollingstone sli soundcloud soundgasm spankbang spotify strawpoll streamable timeanddate tinypic
touhouradio tumblr twimg twitch twitter vid vimeo vine vkaao vocaroo voyagefusion walmart wciu wikimedia wikipedia
xhamster xkcd xvideos youtu youtube youtubedoubler ytimg zillexplorer""".split())

# Megatron's list as written, except the fused '.7z.ai' (missing comma upstream) is split into '.7z' and '.ai'.
MEGATRON_BAD_EXTENSIONS = tuple("""
.3gp .7z .ai .aif .apk .app .avi .bin .bmp .bz2 .css .csv .dat .deb .dmg .doc .docx .exe .gif .gifv .gz .iso .jar
.jpeg .jpg .js .log .mid .midi .mkv .mov .mp3 .mp4 .mpeg .mpg .ogg .ogv .otf .pdf .pkg .png .pps .ppt .pptx .psd .py
.qt .ram .rar .sql .svg .swf .tar.gz .tar .tgz .tiff .ttf .txt .wav .webm .wma .wmv .xls .xlsx .xml .xz .zip""".split())

# Django-style URL validator used by Megatron's blacklist and eukaryote31's filter.py.
URL_REGEX = re.compile(
    r"^(?:http)s?://"
    r"(?:(?:[A-Z0-9](?:[A-Z0-9-]{0,61}[A-Z0-9])?\.)+(?:[A-Z]{2,6}\.?|[A-Z0-9-]{2,}\.?)|"
    r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})"
    r"(?::\d+)?"
    r"(?:/?|[/?]\S+)$",
    re.IGNORECASE,
)

_EXTRACT = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


@functools.lru_cache(maxsize=1 << 16)
def split_host(url: str) -> tuple[str, str, str]:
    """(subdomain, registrable label, public suffix) of ``url`` from the bundled PSL snapshot."""
    parts = _EXTRACT(url)
    return parts.subdomain, parts.domain, parts.suffix


def path_part(url: str) -> str:
    """The lower-cased URL path: no host, query or fragment (upstream used ``url.split('?')[0]``).

    Fix: upstream's pre-``?`` string still held the host (so ``https://x.ai`` counted as an ``.ai`` file)
    and the fragment (so ``x.pdf#page=2`` passed). Testing the path alone avoids both.
    """
    try:
        return urlsplit(url).path.lower()
    except ValueError:  # e.g. an unbalanced IPv6 bracket: fall back to upstream's rule
        return url.split("?")[0].lower()


def jcp_bad_reason(url: str) -> str | None:
    """jcpeterson ``is_bad_url``: reason ("domain", "extension", "short") or None when the URL is fine."""
    sub, dom, suffix = split_host(url)
    full = ".".join(p for p in (sub, dom, suffix) if p)
    base = f"{dom}.{suffix}"
    if full in JCP_BAD_DOMAINS or base in JCP_BAD_DOMAINS:
        return "domain"
    if path_part(url).endswith(JCP_BAD_EXTENSIONS):
        return "extension"
    if len(url) < 10:
        return "short"
    return None


def megatron_bad_reason(url: str) -> str | None:
    """Megatron ``blacklist_urls.py`` checks in upstream order: domain, extension, short, malformed."""
    if split_host(url)[1] in MEGATRON_BAD_LABELS:
        return "domain"
    if path_part(url).endswith(MEGATRON_BAD_EXTENSIONS):
        return "extension"
    if len(url) <= 8:
        return "short"
    if not URL_REGEX.match(url):
        return "malformed"
    return None
