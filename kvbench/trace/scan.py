"""The compiled core of kvbench.trace.pieces's reader: JSON lines of the trace format (spec §2) read
straight into flat arrays of pieces, with no Python object per request or segment.

It recognises one general, strict subset of the format and takes no chances outside it: a line is
read here only if it is an object whose keys and strings are printable ASCII without escapes (so its
bytes are its UTF-8 text, and no lone surrogate can hide in it), whose numbers the fields' rules
accept as they stand (integers in range, written canonically), whose segments are ``shared``/``len``,
``unique`` or ``tokens`` (``text`` needs the tokenizer), with no key given twice, nothing nested
deeper than MAX_DEPTH and nothing after the closing brace but JSON white space. Every other line is
marked for the full parser (kvbench.trace.format.parse_request), which reads it, or raises the
error it would have raised anyway: for a line read here, every rule of parse_request holds, except
two left to the caller: ``t``'s range (its text is handed back: Python's float() is the parser's
rounding) and unique ids (a set of the lines' ids, in order).

Pieces are kvbench.trace.ideal._flatten's: a named stream (a ``shared`` segment, the answer a request
names) is (xxh64 of its name, length); a ``unique`` segment the stream unique_stream names; literal
tokens (their place in ``literals``, length). Names are counted per request (``count_names``), which
is PrefixKeys.count_once's rule, by their bytes.
"""
from __future__ import annotations

import numpy as np

from kvbench.jit import numba
from kvbench.trace.compiled import xxh64

MAX_DEPTH = 64  # nesting of a value read past (meta, unknown keys); deeper: the full parser
MAX_DIGITS = 18  # the integers read here (all fields' limits are far below 10**18)
MAX_NUMBER_DIGITS = 4000  # a longer integer anywhere: the full parser (Python's limit is 4,300)
# kvbench.trace.format's limits, restated (tests/test_pieces.py holds them equal): numba freezes a
# global into the code it caches, and its cache is stale only when this file changes
MAX_NAME = 4096  # format.MAX_NAME_CHARS (ASCII: one byte a character)
MAX_TOKENS = 2**24  # format.MAX_REQUEST_TOKENS
MAX_SAMPLES = 1024  # format.MAX_SAMPLES
MAX_TOKEN_ID = 2**31 - 1  # format.MAX_TOKEN_ID
MAX_LINE = 64 * 2**20  # format.MAX_LINE_BYTES (counting the newline, as readline returns it)

# top-level keys; a segment's
_KEYS = (b"id", b"t", b"output_len", b"prompt", b"session", b"n", b"output", b"meta")
K_ID, K_T, K_OUTPUT_LEN, K_PROMPT, K_SESSION, K_N, K_OUTPUT, K_META, K_OTHER = range(9)
_SEG_KEYS = (b"shared", b"len", b"unique", b"tokens")
S_SHARED, S_LEN, S_UNIQUE, S_TOKENS, S_OTHER = range(5)
_KEY_BYTES = np.frombuffer(b"".join(_KEYS), dtype=np.uint8).copy()
_KEY_AT = np.cumsum([0] + [len(k) for k in _KEYS]).astype(np.int64)
_SEG_BYTES = np.frombuffer(b"".join(_SEG_KEYS), dtype=np.uint8).copy()
_SEG_AT = np.cumsum([0] + [len(k) for k in _SEG_KEYS]).astype(np.int64)
_UNIQUE_PREFIX = np.frombuffer(b"\x00unique/", dtype=np.uint8).copy()  # tokens._UNIQUE_PREFIX's bytes (held equal)

# fields of a line read here (``req``: int64 [lines, R_FIELDS]); spans are [start, end) in the buffer
(R_ID_A, R_ID_B, R_ID_KIND, R_T_A, R_T_B, R_OUTPUT_LEN, R_SESSION_A, R_SESSION_B, R_SESSION_KIND,
 R_OUTPUT_A, R_OUTPUT_B, R_PIECE_A, R_PIECE_B, R_PROMPT_LEN) = range(14)
R_FIELDS = 14
# an id or a session: none (the line's number is the id), a string's characters, an integer's digits
ABSENT, NAME, INT = 0, 1, 2

_SP, _TAB, _CR, _NL = 32, 9, 13, 10
_QUOTE, _BSLASH, _COLON, _COMMA = 34, 92, 58, 44
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93
_MINUS, _PLUS, _DOT, _ZERO, _NINE = 45, 43, 46, 48, 57


@numba.njit(cache=True)
def bounds(buf):
    """(lines, '{' count, ',' + ']' count): room enough for the lines, pieces and literal tokens."""
    lines, braces, seps = 1, 0, 0
    for c in buf:
        if c == _NL:
            lines += 1
        elif c == _LBRACE:
            braces += 1
        elif c == _COMMA or c == _RBRACKET:
            seps += 1
    return lines, braces, seps


@numba.njit(cache=True, inline="always")
def _ws(buf, i, e):
    while i < e and (buf[i] == _SP or buf[i] == _TAB or buf[i] == _CR):
        i += 1
    return i


@numba.njit(cache=True)
def _string(buf, i, e):
    """The end (past the closing quote) of the string at i, if it is printable ASCII with no escape;
    -1 otherwise."""
    if i >= e or buf[i] != _QUOTE:
        return -1
    i += 1
    while i < e:
        c = buf[i]
        if c == _QUOTE:
            return i + 1
        if c < 32 or c > 127 or c == _BSLASH:
            return -1
        i += 1
    return -1


@numba.njit(cache=True)
def _uint(buf, i, e):
    """(value, end) of the non-negative integer at i, written canonically (no sign, no leading zero),
    of at most MAX_DIGITS digits; (-1, -1) otherwise. A fraction or exponent after it (JSON's float) is
    refused by the caller, which expects a separator there."""
    j = i
    v = 0
    while j < e and _ZERO <= buf[j] <= _NINE:
        v = v * 10 + (buf[j] - _ZERO)
        j += 1
    n = j - i
    if n == 0 or n > MAX_DIGITS or (buf[i] == _ZERO and n > 1):
        return -1, -1
    return v, j


@numba.njit(cache=True)
def _digit_run(buf, j, e):
    while j < e and _ZERO <= buf[j] <= _NINE:
        j += 1
    return j


@numba.njit(cache=True)
def _number(buf, i, e):
    """The end of the JSON number at i, or -1 (not one, or an integer Python would refuse to read)."""
    d = i + 1 if i < e and buf[i] == _MINUS else i
    j = _digit_run(buf, d, e)
    if j == d or (buf[d] == _ZERO and j - d > 1):
        return -1
    whole = j - d
    real = False
    if j < e and buf[j] == _DOT:  # a fraction
        f = _digit_run(buf, j + 1, e)
        if f == j + 1:
            return -1
        j, real = f, True
    if j < e and (buf[j] == 101 or buf[j] == 69):  # an exponent: e or E
        x = j + 2 if j + 1 < e and (buf[j + 1] == _PLUS or buf[j + 1] == _MINUS) else j + 1
        j = _digit_run(buf, x, e)
        if j == x:
            return -1
        real = True
    if not real and whole > MAX_NUMBER_DIGITS:
        return -1
    return j


@numba.njit(cache=True)
def _word(buf, i, e, w0, w1, w2, w3, w4, n):
    """The end of the literal (true, false, null) of n bytes at i, or -1."""
    if i + n > e or buf[i] != w0 or buf[i + 1] != w1 or buf[i + 2] != w2 or buf[i + 3] != w3:
        return -1
    if n == 5 and buf[i + 4] != w4:
        return -1
    return i + n


@numba.njit(cache=True)
def _null(buf, i, e):
    return _word(buf, i, e, 110, 117, 108, 108, 0, 4)


@numba.njit(cache=True)
def _key_then_colon(buf, i, e):
    """(key start, key end, position after the colon) of ``"key" :`` at i; key end -1 if not one."""
    j = _string(buf, i, e)
    if j < 0:
        return 0, -1, 0
    k = _ws(buf, j, e)
    if k >= e or buf[k] != _COLON:
        return 0, -1, 0
    return i + 1, j - 1, _ws(buf, k + 1, e)


@numba.njit(cache=True)
def _skip(buf, i, e, stack):
    """The end of the JSON value at i, or -1: any value of printable ASCII strings without escapes,
    nested at most MAX_DEPTH deep (what a value the format ignores must be to be read here)."""
    depth = 0
    while True:
        i = _ws(buf, i, e)
        if i >= e:
            return -1
        c = buf[i]
        if c == _LBRACE or c == _LBRACKET:
            close = _RBRACE if c == _LBRACE else _RBRACKET
            j = _ws(buf, i + 1, e)
            if j < e and buf[j] == close:
                i = j + 1
            else:
                if depth == MAX_DEPTH:
                    return -1
                stack[depth] = close
                depth += 1
                if c == _LBRACE:
                    _, kb, j = _key_then_colon(buf, j, e)
                    if kb < 0:
                        return -1
                i = j
                continue  # the first member's value
        elif c == _QUOTE:
            i = _string(buf, i, e)
        elif c == 116:  # true
            i = _word(buf, i, e, 116, 114, 117, 101, 0, 4)
        elif c == 102:  # false
            i = _word(buf, i, e, 102, 97, 108, 115, 101, 5)
        elif c == 110:
            i = _null(buf, i, e)
        else:
            i = _number(buf, i, e)
        if i < 0:
            return -1
        while True:  # after a value: the next member, or close containers
            if depth == 0:
                return i
            i = _ws(buf, i, e)
            if i >= e:
                return -1
            if buf[i] == _COMMA:
                i = _ws(buf, i + 1, e)
                if stack[depth - 1] == _RBRACE:
                    _, kb, i = _key_then_colon(buf, i, e)
                    if kb < 0:
                        return -1
                break
            if buf[i] != stack[depth - 1]:
                return -1
            i += 1
            depth -= 1


@numba.njit(cache=True)
def _after(buf, i, e, close):
    """After a member of a container: (1, past the comma and white space) if another follows, (0, past
    ``close``) if the container ends here, (-1, i) otherwise."""
    i = _ws(buf, i, e)
    if i < e and buf[i] == _COMMA:
        return 1, _ws(buf, i + 1, e)
    if i < e and buf[i] == close:
        return 0, i + 1
    return -1, i


@numba.njit(cache=True)
def _key_code(buf, a, b, table, at):
    n = b - a
    for k in range(len(at) - 1):
        if at[k + 1] - at[k] != n:
            continue
        same = True
        for x in range(n):
            if buf[a + x] != table[at[k] + x]:
                same = False
                break
        if same:
            return k
    return len(at) - 1


@numba.njit(cache=True)
def _name(buf, i, e, empty_ok):
    """The end of a name (a string of at most MAX_NAME characters; non-empty unless empty_ok), or -1."""
    j = _string(buf, i, e)
    if j < 0 or j - i - 2 > MAX_NAME or (j - i == 2 and not empty_ok):
        return -1
    return j


@numba.njit(cache=True)
def _name_or_int(buf, i, e, empty_ok):
    """An id or a session at i: (NAME, its characters' span, past it) for a string, (INT, its digits'
    span, past it) for an integer (Python's str() of it); kind -1 for neither."""
    if i < e and buf[i] == _QUOTE:
        j = _name(buf, i, e, empty_ok)
        return (NAME if j >= 0 else -1), i + 1, j - 1, j
    v, j = _uint(buf, i, e)
    return (INT if v >= 0 else -1), i, j, j


# inlined into _request: a call passing its 14 arrays costs more than reading the segment (the scan
# of Mooncake took 93 ms with the call, 57 ms without; inlining the small helpers too made it slower)
@numba.njit(cache=True, inline="always")
def _segment(buf, i, e, k, seeds, lengths, literal_at, occ, lits, cnt, req_index, occ_req, occ_a, occ_b,
             occ_seed):
    """Read the segment at i (prompt[k]) into the next piece: (its end, its tokens); (-1, 0) if it is
    not one this reader takes. A unique segment's seed is left for the line's end (it needs the id)."""
    if i >= e or buf[i] != _LBRACE:
        return -1, 0
    i = _ws(buf, i + 1, e)
    seen = 0
    name_a = name_b = -1
    length = 0
    lit0 = cnt[1]
    while True:
        ka, kb, i = _key_then_colon(buf, i, e)
        if kb < 0:
            return -1, 0
        code = _key_code(buf, ka, kb, _SEG_BYTES, _SEG_AT)
        if code == S_OTHER:
            return -1, 0  # a key given twice is read as JSON reads it: the last value
        seen |= 1 << code
        if code == S_SHARED:
            j = _name(buf, i, e, False)
            if j < 0:
                return -1, 0
            name_a, name_b, i = i + 1, j - 1, j
        elif code == S_LEN or code == S_UNIQUE:
            v, i = _uint(buf, i, e)
            if v < 1 or v > MAX_TOKENS:
                return -1, 0
            length = v
        else:  # tokens: a non-empty list of ids
            if i >= e or buf[i] != _LBRACKET:
                return -1, 0
            i = _ws(buf, i + 1, e)
            n = 0
            while True:
                v, i = _uint(buf, i, e)
                # room: scan_lines gives a slot per ',' or ']' in the file, one short for a list cut
                # short (no ']'), which is the full parser's (numba does not check bounds)
                if v < 0 or v > MAX_TOKEN_ID or lit0 + n >= len(lits):
                    return -1, 0
                lits[lit0 + n] = v
                n += 1
                more, i = _after(buf, i, e, _RBRACKET)
                if more < 0:
                    return -1, 0
                if not more:
                    break
            length = n
        more, i = _after(buf, i, e, _RBRACE)
        if more < 0:
            return -1, 0
        if not more:
            break
    p = cnt[0]
    lengths[p] = length
    literal_at[p] = -1
    occ[p] = -1
    if seen == (1 << S_SHARED) | (1 << S_LEN):
        seeds[p] = xxh64(buf, name_a, name_b - name_a)
        o = cnt[2]
        occ_req[o], occ_a[o], occ_b[o], occ_seed[o] = req_index, name_a, name_b, seeds[p]
        occ[p] = o
        cnt[2] = o + 1
    elif seen == 1 << S_UNIQUE:
        seeds[p] = 0
        occ[p] = -2 - k  # the seed at the line's end
    elif seen == 1 << S_TOKENS:
        seeds[p] = 0
        literal_at[p] = lit0
        cnt[1] = lit0 + length
    else:
        return -1, 0
    cnt[0] = p + 1
    return i, length


@numba.njit(cache=True)
def _unique_seed(buf, id_a, id_b, lineno, k, scratch):
    """stable_hash(unique_stream(id, k)): xxh64 of b"\\x00unique/" + id + b"/" + str(k)."""
    n = 0
    for c in _UNIQUE_PREFIX:
        scratch[n] = c
        n += 1
    if id_b < 0:  # no id: the line's number
        n = _digits(scratch, n, lineno)
    else:
        for x in range(id_a, id_b):
            scratch[n] = buf[x]
            n += 1
    scratch[n] = 47  # '/'
    n = _digits(scratch, n + 1, k)
    return xxh64(scratch, 0, n)


@numba.njit(cache=True)
def _digits(out, n, v):
    if v == 0:
        out[n] = _ZERO
        return n + 1
    m = 0
    x = v
    while x:
        m += 1
        x //= 10
    for j in range(m - 1, -1, -1):
        out[n + j] = _ZERO + v % 10
        v //= 10
    return n + m


@numba.njit(cache=True)
def _line(buf, a, e, lineno, r, req, seeds, lengths, literal_at, occ, lits, cnt,
          occ_req, occ_a, occ_b, occ_seed, stack, scratch):
    """Read line [a, e) as request ``r`` (its fields into req[r], its pieces and names appended);
    False, with nothing appended, if it is not a line this reader takes."""
    saved0, saved1, saved2 = cnt[0], cnt[1], cnt[2]
    ok = _request(buf, a, e, lineno, r, req, seeds, lengths, literal_at, occ, lits, cnt,
                  occ_req, occ_a, occ_b, occ_seed, stack, scratch)
    if not ok:
        cnt[0], cnt[1], cnt[2] = saved0, saved1, saved2
    return ok


@numba.njit(cache=True)
def _request(buf, a, e, lineno, r, req, seeds, lengths, literal_at, occ, lits, cnt,
             occ_req, occ_a, occ_b, occ_seed, stack, scratch):
    i = _ws(buf, a, e)
    if i >= e or buf[i] != _LBRACE:
        return False
    i = _ws(buf, i + 1, e)
    seen = 0
    f = req[r]
    f[R_ID_A], f[R_ID_B], f[R_ID_KIND] = 0, -1, ABSENT
    f[R_SESSION_A], f[R_SESSION_B], f[R_SESSION_KIND] = 0, 0, ABSENT
    f[R_OUTPUT_A], f[R_OUTPUT_B] = -1, -1
    f[R_PIECE_A] = cnt[0]
    plen = 0
    while True:
        ka, kb, i = _key_then_colon(buf, i, e)
        if kb < 0:
            return False
        code = _key_code(buf, ka, kb, _KEY_BYTES, _KEY_AT)
        if code != K_OTHER:
            if seen & (1 << code):
                return False  # JSON keeps the last: the full parser decides
            seen |= 1 << code
        if code == K_ID:
            kind, f[R_ID_A], f[R_ID_B], i = _name_or_int(buf, i, e, False)
            if kind < 0:
                return False
            f[R_ID_KIND] = kind
        elif code == K_T:
            if i < e and buf[i] == _MINUS:
                return False  # below 0, or -0 (an integer 0, a float -0.0): the full parser
            j = _number(buf, i, e)
            if j < 0:
                return False
            f[R_T_A], f[R_T_B], i = i, j, j
        elif code == K_OUTPUT_LEN or code == K_N:
            v, i = _uint(buf, i, e)
            if v < 1 or v > (MAX_TOKENS if code == K_OUTPUT_LEN else MAX_SAMPLES):
                return False
            if code == K_OUTPUT_LEN:
                f[R_OUTPUT_LEN] = v
        elif code == K_SESSION:
            if i < e and buf[i] == 110:
                i = _null(buf, i, e)
            else:
                kind, f[R_SESSION_A], f[R_SESSION_B], i = _name_or_int(buf, i, e, True)
                if kind < 0:
                    return False
                f[R_SESSION_KIND] = kind
        elif code == K_OUTPUT:
            if i < e and buf[i] == 110:
                i = _null(buf, i, e)
            else:
                j = _name(buf, i, e, False)
                if j < 0:
                    return False
                f[R_OUTPUT_A], f[R_OUTPUT_B], i = i + 1, j - 1, j
        elif code == K_PROMPT:
            if i >= e or buf[i] != _LBRACKET:
                return False
            i = _ws(buf, i + 1, e)
            k = 0
            while True:
                i, n = _segment(buf, i, e, k, seeds, lengths, literal_at, occ, lits, cnt, r,
                                occ_req, occ_a, occ_b, occ_seed)
                if i < 0:
                    return False
                plen += n
                k += 1
                more, i = _after(buf, i, e, _RBRACKET)
                if more < 0:
                    return False
                if not more:
                    break
        elif code == K_META:
            if i < e and buf[i] == 110:
                i = _null(buf, i, e)
            elif i < e and buf[i] == _LBRACE:
                i = _skip(buf, i, e, stack)
            else:
                return False
        else:  # a key the format ignores
            i = _skip(buf, i, e, stack)
        if i < 0:
            return False
        more, i = _after(buf, i, e, _RBRACE)
        if more < 0:
            return False
        if not more:
            break
    if _ws(buf, i, e) != e:
        return False
    if seen & ((1 << K_T) | (1 << K_PROMPT) | (1 << K_OUTPUT_LEN)) != (1 << K_T) | (1 << K_PROMPT) | (1 << K_OUTPUT_LEN):
        return False
    if plen + f[R_OUTPUT_LEN] > MAX_TOKENS:
        return False
    f[R_PROMPT_LEN] = plen
    for p in range(f[R_PIECE_A], cnt[0]):
        if occ[p] <= -2:  # R_ID_B is -1 without an id
            seeds[p] = _unique_seed(buf, f[R_ID_A], f[R_ID_B], lineno, -2 - occ[p], scratch)
            occ[p] = -1
    if f[R_OUTPUT_B] >= 0:  # the answer's name counts as the request's (count_once), piece or not
        o = cnt[2]
        occ_req[o], occ_a[o], occ_b[o] = r, f[R_OUTPUT_A], f[R_OUTPUT_B]
        occ_seed[o] = xxh64(buf, f[R_OUTPUT_A], f[R_OUTPUT_B] - f[R_OUTPUT_A])
        cnt[2] = o + 1
        if f[R_OUTPUT_LEN] > 1:  # the answer's computed part (ideal.cached_answer_len)
            p = cnt[0]
            seeds[p] = occ_seed[o]
            lengths[p] = f[R_OUTPUT_LEN] - 1
            literal_at[p] = -1
            occ[p] = o
            cnt[0] = p + 1
    f[R_PIECE_B] = cnt[0]
    return True


@numba.njit(cache=True)
def scan(buf, req, line_ok, line_at, seeds, lengths, literal_at, occ, lits, occ_req, occ_a, occ_b, occ_seed,
         id_room):
    """Every line of ``buf`` (a trace file's bytes; line l + 1 is buf[line_at[l]:line_at[l + 1]], its
    newline included): line_ok[l] says whether it was read here; then req[l] holds its fields, pieces
    req[l, R_PIECE_A]:req[l, R_PIECE_B] are its own (``occ[p]``: the piece's name occurrence, -1 for
    none) and its names' occurrences (occ_req: l) are among the others. Returns (lines, pieces,
    literal tokens, name occurrences)."""
    cnt = np.zeros(3, dtype=np.int64)  # pieces, literal tokens, name occurrences
    stack = np.empty(MAX_DEPTH, dtype=np.uint8)
    scratch = np.empty(len(_UNIQUE_PREFIX) + id_room + 24, dtype=np.uint8)
    n = len(buf)
    a = 0
    lineno = 0
    while a < n:
        e = a
        while e < n and buf[e] != _NL:
            e += 1
        lineno += 1
        line_at[lineno - 1] = a
        room = e - a + (1 if e < n else 0)
        line_ok[lineno - 1] = room <= MAX_LINE and _line(
            buf, a, e, lineno, lineno - 1, req, seeds, lengths, literal_at, occ, lits, cnt,
            occ_req, occ_a, occ_b, occ_seed, stack, scratch)
        a = e + 1
    line_at[lineno] = n
    return lineno, cnt[0], cnt[1], cnt[2]


@numba.njit(cache=True)
def count_names(names, occ_req, occ_a, occ_b, occ_seed):
    """uses[o]: how many requests name the stream of name occurrence o (its bytes names[occ_a[o]:
    occ_b[o]], its xxh64 occ_seed[o]; occurrences in request order), from an open-addressed table
    keyed by the seed and confirmed on the bytes."""
    n = len(occ_req)
    cap = 1024
    while cap < 2 * n:
        cap *= 2
    slot_of = np.full(cap, -1, dtype=np.int64)  # the first occurrence of the name in each slot
    name_of = np.empty(n, dtype=np.int64)  # each occurrence's first occurrence
    uses = np.zeros(n, dtype=np.int64)  # by first occurrence
    last = np.full(n, -1, dtype=np.int64)  # the last request counted, by first occurrence
    for o in range(n):
        i = np.int64(occ_seed[o] & np.uint64(cap - 1))
        while True:
            f = slot_of[i]
            if f < 0:
                slot_of[i] = o
                name_of[o] = o
                break
            if occ_seed[f] == occ_seed[o] and occ_b[f] - occ_a[f] == occ_b[o] - occ_a[o]:
                same = True
                for x in range(occ_b[o] - occ_a[o]):
                    if names[occ_a[f] + x] != names[occ_a[o] + x]:
                        same = False
                        break
                if same:
                    name_of[o] = f
                    break
            i = (i + 1) & (cap - 1)
        f = name_of[o]
        if last[f] != occ_req[o]:
            last[f] = occ_req[o]
            uses[f] += 1
    return uses[name_of]
