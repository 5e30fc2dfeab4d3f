"""The compiled cores of kvbench.trace.tokens and kvbench.trace.ideal (numba, ``cache=True``): token
streams, xxh3_64, chained block keys, a trace's keys with a memo of shared segments, dense ids.

Imported on first use (``tokens.compiled()``), so commands that never hash pay nothing for numba.
Every function here computes exactly what its Python/C twin did before it (tests/test_tokens.py and
tests/test_prefix_keys.py hold them equal): ``fill_stream`` splitmix64's finaliser as ``stream_tokens``
documents it, ``xxh3`` the xxHash library's XXH3_64bits_withSeed (xxhash 0.8's algorithm, restated for
inputs whose length is a multiple of 4 bytes: they are int32 tokens, read here as uint32 words).

Integer care: numba turns ``uint64 op int64`` into a float, so every constant is a ``_U`` and every
shift count too.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from kvbench.jit import numba
from numba.core import types  # (after kvbench.jit, which settles numba's cache directory)
from numba.extending import intrinsic

_U = np.uint64
_M32 = _U(0xFFFFFFFF)
_S32 = _U(32)
TOKEN_LO, TOKEN_HI = 16, 32000  # kvbench.trace.tokens's, restated (tests/test_tokens.py holds them equal):
# numba freezes a global into the code it caches, and its cache is stale only when this file changes
_SPAN = _U(TOKEN_HI - TOKEN_LO)
_GOLDEN, _M1, _M2 = _U(0x9E3779B97F4A7C15), _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_R32 = _U(2**32 % (TOKEN_HI - TOKEN_LO))  # 2**32 mod the span (fill_stream's remainder by halves)

_P32_1, _P32_2, _P32_3 = _U(0x9E3779B1), _U(0x85EBCA77), _U(0xC2B2AE3D)
_P64_1, _P64_2, _P64_3 = _U(0x9E3779B185EBCA87), _U(0xC2B2AE3D27D4EB4F), _U(0x165667B19E3779F9)
_P64_4, _P64_5 = _U(0x85EBCA77C2B2AE63), _U(0x27D4EB2F165667C5)
_MX1, _MX2 = _U(0x165667919E3779F9), _U(0x9FB21C651E98DF25)

# XXH3's default secret (kSecret, 192 bytes), as published in xxhash.h
_SECRET = np.frombuffer(bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"), dtype=np.uint8)
# _AT[o]: the little-endian 64-bit word at byte o of the secret; _WORDS: its 24 aligned words
_AT = np.array([int.from_bytes(_SECRET[o:o + 8].tobytes(), "little") for o in range(185)], dtype=np.uint64)
_WORDS = _AT[::8].copy()


@numba.njit(cache=True)
def fill_stream(out, seed, start):
    """out[j] = token start + j of the stream whose name hashes to ``seed`` (out: int32 [n]).

    The 64-bit remainder is taken from the value's 32-bit halves, x = hi * 2**32 + lo:
    x mod m = ((hi mod m) * (2**32 mod m) + lo mod m) mod m, exact. Each remainder is then of a value
    below 2**32 (hi reduced first for that, not for the value), which LLVM vectorises where it does
    not a 64-bit one: ~0.7-0.8 ns a token here against ~2.7."""
    x = _U(start + 1) * _GOLDEN + _U(seed)
    for j in range(len(out)):
        z = x
        z ^= z >> _U(30)
        z *= _M1
        z ^= z >> _U(27)
        z *= _M2
        z ^= z >> _U(31)
        r = (z >> _S32) % _SPAN * _R32 + (z & _M32) % _SPAN
        out[j] = np.int32(r % _SPAN) + np.int32(TOKEN_LO)
        x += _GOLDEN


# ------------------------------------------------------------------------------------ xxh3_64

@intrinsic
def _fold(typingctx, a, b):
    """The 128-bit product a * b (uint64 each), its halves xor-ed (XXH3_mul128_fold64): one
    64x64->128 multiply in LLVM's i128, where numba's integers stop at 64 bits (four 32-bit products
    and their carries cost ~20 ns of a 64-byte block's ~35)."""
    if a != types.uint64 or b != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        i64, i128 = ir.IntType(64), ir.IntType(128)
        product = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        upper = builder.trunc(builder.lshr(product, ir.Constant(i128, 64)), i64)
        return builder.xor(builder.trunc(product, i64), upper)

    return types.uint64(types.uint64, types.uint64), codegen


@numba.njit(cache=True, inline="always")
def _avalanche(h):
    h ^= h >> _U(37)
    h *= _MX1
    return h ^ (h >> _S32)


@numba.njit(cache=True, inline="always")
def _avalanche64(h):
    h ^= h >> _U(33)
    h *= _P64_2
    h ^= h >> _U(29)
    h *= _P64_3
    return h ^ (h >> _S32)


@numba.njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << _U(r)) | (x >> _U(64 - r))


@numba.njit(cache=True, inline="always")
def _bswap64(x):
    r = _U(0)
    for _ in range(8):
        r = (r << _U(8)) | (x & _U(0xFF))
        x >>= _U(8)
    return r


@numba.njit(cache=True, inline="always")
def _read64(w, i):
    """The little-endian 64-bit word at uint32 word i of w."""
    return _U(w[i]) | (_U(w[i + 1]) << _S32)


@numba.njit(cache=True, inline="always")
def _mix16(w, i, so, seed):
    """XXH3_mix16B: 16 input bytes from word i, the secret's bytes from so."""
    return _fold(_read64(w, i) ^ (_AT[so] + seed), _read64(w, i + 2) ^ (_AT[so + 8] - seed))


@numba.njit(cache=True)
def xxh3(w, off, n_words, seed, acc, custom):
    """XXH3_64bits_withSeed of the 4 * n_words bytes at uint32 word ``off`` of ``w``. ``acc`` (uint64
    [8]) and ``custom`` (uint64 [24]) are scratch, so that a loop of hashes allocates nothing."""
    n = _U(4 * n_words)
    if n_words <= 4:  # 0 to 16 bytes
        if n_words > 2:  # 9 to 16
            lo = _read64(w, off) ^ ((_AT[24] ^ _AT[32]) + seed)
            hi = _read64(w, off + n_words - 2) ^ ((_AT[40] ^ _AT[48]) - seed)
            return _avalanche(n + _bswap64(lo) + hi + _fold(lo, hi))
        if n_words > 0:  # 4 to 8
            s32 = seed & _M32
            swapped = ((s32 & _U(0xFF)) << _U(24)) | ((s32 & _U(0xFF00)) << _U(8)) \
                | ((s32 >> _U(8)) & _U(0xFF00)) | (s32 >> _U(24))
            s = seed ^ (swapped << _S32)
            x = (_U(w[off + n_words - 1]) + (_U(w[off]) << _S32)) ^ ((_AT[8] ^ _AT[16]) - s)
            x ^= _rotl(x, 49) ^ _rotl(x, 24)
            x *= _MX2
            x ^= (x >> _U(35)) + n
            x *= _MX2
            return x ^ (x >> _U(28))
        return _avalanche64(seed ^ (_AT[56] ^ _AT[64]))
    if n_words <= 32:  # 17 to 128 bytes
        h = n * _P64_1
        last = off + n_words
        if n_words > 8:
            if n_words > 16:
                if n_words > 24:
                    h += _mix16(w, off + 12, 96, seed)
                    h += _mix16(w, last - 16, 112, seed)
                h += _mix16(w, off + 8, 64, seed)
                h += _mix16(w, last - 12, 80, seed)
            h += _mix16(w, off + 4, 32, seed)
            h += _mix16(w, last - 8, 48, seed)
        h += _mix16(w, off, 0, seed)
        h += _mix16(w, last - 4, 16, seed)
        return _avalanche(h)
    if n_words <= 60:  # 129 to 240 bytes
        h = n * _P64_1
        for i in range(8):
            h += _mix16(w, off + 4 * i, 16 * i, seed)
        h = _avalanche(h)
        for i in range(8, n_words // 4):
            h += _mix16(w, off + 4 * i, 16 * (i - 8) + 3, seed)
        h += _mix16(w, off + n_words - 4, 136 - 17, seed)
        return _avalanche(h)
    # longer: stripes of 64 bytes into 8 accumulators, with a secret derived from the seed
    for j in range(12):
        custom[2 * j] = _WORDS[2 * j] + seed
        custom[2 * j + 1] = _WORDS[2 * j + 1] - seed
    acc[0], acc[1], acc[2], acc[3] = _P32_3, _P64_1, _P64_2, _P64_3
    acc[4], acc[5], acc[6], acc[7] = _P64_4, _P32_2, _P64_5, _P32_1
    n_stripes = (4 * n_words - 1) // 64
    for stripe in range(n_stripes):
        k = stripe % 16  # 16 stripes a block, then a scramble
        base = off + 16 * stripe
        for i in range(8):
            v = _read64(w, base + 2 * i)
            key = v ^ custom[k + i]
            acc[i ^ 1] += v
            acc[i] += (key & _M32) * (key >> _S32)
        if k == 15:
            for i in range(8):
                a = acc[i]
                a ^= a >> _U(47)
                a ^= custom[16 + i]
                acc[i] = a * _P32_1
    base = off + n_words - 16  # the last 64 bytes, against the secret's bytes 121..184
    for i in range(8):
        v = _read64(w, base + 2 * i)
        key = v ^ ((custom[15 + i] >> _U(8)) | (custom[16 + i] << _U(56)))
        acc[i ^ 1] += v
        acc[i] += (key & _M32) * (key >> _S32)
    h = n * _P64_1
    for i in range(4):  # merge against the secret's bytes 11..74
        k0 = (custom[1 + 2 * i] >> _U(24)) | (custom[2 + 2 * i] << _U(40))
        k1 = (custom[2 + 2 * i] >> _U(24)) | (custom[3 + 2 * i] << _U(40))
        h += _fold(acc[2 * i] ^ k0, acc[2 * i + 1] ^ k1)
    return _avalanche(h)


@numba.njit(cache=True, inline="always")
def _bytes64(b, i):
    """The little-endian 64-bit word at byte i of a uint8 array."""
    r = _U(0)
    for k in range(7, -1, -1):
        r = (r << _U(8)) | _U(b[i + k])
    return r


@numba.njit(cache=True, inline="always")
def _round64(acc, v):
    acc += v * _P64_2
    return _rotl(acc, 31) * _P64_1


@numba.njit(cache=True)
def xxh64(b, off, n):
    """XXH64 of the n bytes at ``off`` of a uint8 array, seed 0 (xxhash.xxh64_intdigest: the seed of a
    stream's name, kvbench.trace.tokens.stable_hash, for kvbench.trace.scan's reader)."""
    p, end = off, off + n
    if n >= 32:
        v1, v2, v3, v4 = _P64_1 + _P64_2, _P64_2, _U(0), _U(0) - _P64_1
        while p + 32 <= end:
            v1 = _round64(v1, _bytes64(b, p))
            v2 = _round64(v2, _bytes64(b, p + 8))
            v3 = _round64(v3, _bytes64(b, p + 16))
            v4 = _round64(v4, _bytes64(b, p + 24))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        for v in (v1, v2, v3, v4):
            h = (h ^ _round64(_U(0), v)) * _P64_1 + _P64_4
    else:
        h = _P64_5
    h += _U(n)
    while p + 8 <= end:
        h = _rotl(h ^ _round64(_U(0), _bytes64(b, p)), 27) * _P64_1 + _P64_4
        p += 8
    if p + 4 <= end:
        w = _U(b[p]) | (_U(b[p + 1]) << _U(8)) | (_U(b[p + 2]) << _U(16)) | (_U(b[p + 3]) << _U(24))
        h = _rotl(h ^ (w * _P64_1), 23) * _P64_2 + _P64_3
        p += 4
    while p < end:
        h = _rotl(h ^ (_U(b[p]) * _P64_5), 11) * _P64_1
        p += 1
    return _avalanche64(h)


# ------------------------------------------------------------------------- chained block keys

@numba.njit(cache=True)
def chain_keys(w, off, n_blocks, words_per_block, parent, out, at, acc, custom):
    """out[at + b] = key of block b of the words from ``off``, chained from ``parent``; returns the last
    key (``parent`` if no block)."""
    key = _U(parent)
    for b in range(n_blocks):
        key = xxh3(w, off + b * words_per_block, words_per_block, key, acc, custom)
        out[at + b] = key
    return key


@numba.njit(cache=True)
def block_keys_of(tokens, n_blocks, block_size, parent):
    """Chained keys of the first n_blocks blocks of an int32 token array (uint64 [n_blocks])."""
    out = np.empty(n_blocks, dtype=np.uint64)
    w = tokens.view(np.uint32)
    chain_keys(w, 0, n_blocks, block_size, parent, out, 0, np.empty(8, np.uint64), np.empty(24, np.uint64))
    return out


# The memo of shared segments' keys: an open-addressed table (linear probing) from (parent key, stream
# seed, length) to a run of keys in ``pool``. state: [entries, pool keys used, hits, flushes]. When either
# is full it is flushed whole (bounded, and exact whatever it forgets: a miss recomputes).
_EMPTY = -1


@numba.njit(cache=True, inline="always")
def _slot(parent, seed, length, mask):
    h = parent ^ (seed * _P64_1) ^ (_U(length) * _P64_2)
    return np.int64(_avalanche(h) & _U(mask))


@numba.njit(cache=True)
def _memo_find(tab_key, tab_len, tab_at, parent, seed, length):
    mask = len(tab_len) - 1
    i = _slot(parent, seed, length, mask)
    while tab_len[i] != _EMPTY:
        if tab_len[i] == length and tab_key[2 * i] == parent and tab_key[2 * i + 1] == seed:
            return tab_at[i]
        i = (i + 1) & mask
    return -1


@numba.njit(cache=True)
def _memo_put(tab_key, tab_len, tab_at, pool, state, parent, seed, length, keys, at, n):
    if n > len(pool):
        return
    if 2 * (state[0] + 1) > len(tab_len) or state[1] + n > len(pool):
        tab_len[:] = _EMPTY
        state[0] = state[1] = 0
        state[3] += 1
    mask = len(tab_len) - 1
    i = _slot(parent, seed, length, mask)
    while tab_len[i] != _EMPTY:
        i = (i + 1) & mask
    tab_key[2 * i], tab_key[2 * i + 1], tab_len[i], tab_at[i] = parent, seed, length, state[1]
    pool[state[1]:state[1] + n] = keys[at:at + n]
    state[0] += 1
    state[1] += n


@numba.njit(cache=True)
def trace_keys(seeds, lengths, literal_at, memoise, pieces_at, literals, block_size, root,
               out_at, out, tab_key, tab_len, tab_at, pool, state):
    """The chained keys of every request's cached sequence, into ``out`` (request r's from out_at[r]).

    Request r is pieces pieces_at[r]..pieces_at[r+1]-1: a stream (``seeds[p]``, its first
    ``lengths[p]`` tokens; literal_at[p] = -1) or literal tokens (literals[literal_at[p]:][:lengths[p]]).
    A stream piece that starts on a block boundary has keys fixed by (parent key, seed, length): where
    ``memoise[p]``, they are looked up in / stored into the memo, so a repeated segment is neither
    generated nor hashed again."""
    longest = 0
    for p in range(len(lengths)):
        longest = max(longest, lengths[p])
    buf = np.empty(longest + block_size, dtype=np.int32)
    w = buf.view(np.uint32)
    acc, custom = np.empty(8, np.uint64), np.empty(24, np.uint64)
    bs = block_size
    for r in range(len(pieces_at) - 1):
        parent = _U(root)
        carry = 0  # tokens of a partial block waiting at buf[:carry]
        o = out_at[r]
        for p in range(pieces_at[r], pieces_at[r + 1]):
            length, seed = lengths[p], seeds[p]
            if literal_at[p] < 0 and carry == 0:
                n_full = length // bs
                found = -1
                if memoise[p] and n_full:
                    found = _memo_find(tab_key, tab_len, tab_at, parent, seed, length)
                if found >= 0:
                    out[o:o + n_full] = pool[found:found + n_full]
                    state[2] += 1
                elif n_full:
                    fill_stream(buf[:n_full * bs], seed, 0)
                    chain_keys(w, 0, n_full, bs, parent, out, o, acc, custom)
                    if memoise[p]:
                        _memo_put(tab_key, tab_len, tab_at, pool, state, parent, seed, length, out, o, n_full)
                if n_full:
                    parent = out[o + n_full - 1]
                    o += n_full
                carry = length - n_full * bs
                if carry:
                    fill_stream(buf[:carry], seed, n_full * bs)
            else:
                if literal_at[p] >= 0:
                    buf[carry:carry + length] = literals[literal_at[p]:literal_at[p] + length]
                else:
                    fill_stream(buf[carry:carry + length], seed, 0)
                total = carry + length
                n_full = total // bs
                if n_full:
                    parent = chain_keys(w, 0, n_full, bs, parent, out, o, acc, custom)
                    o += n_full
                carry = total - n_full * bs
                for j in range(carry):  # the partial block to the front (carry < block size)
                    buf[j] = buf[n_full * bs + j]


@numba.njit(cache=True)
def fill_pieces(seeds, lengths, literal_at, literals, out):
    """The tokens of pieces (trace_keys's: a stream's first lengths[p] tokens, or literal tokens), one
    after another into ``out``; returns how many were written."""
    o = 0
    for p in range(len(lengths)):
        n = lengths[p]
        if literal_at[p] < 0:
            fill_stream(out[o:o + n], seeds[p], 0)
        else:
            out[o:o + n] = literals[literal_at[p]:literal_at[p] + n]
        o += n
    return o


# --------------------------------------------------------------------------------- dense ids

@numba.njit(cache=True)
def dense_ids(keys):
    """(ids, distinct): ids[k] = the index in ``distinct`` of keys[k], distinct in order of first
    appearance (pandas.factorize's answer), from an open-addressed table of (key, id + 1) pairs (0:
    empty; one cache line a probe) sized for every key distinct and grown past 5/8 full. Keys are
    xxh3 outputs, so their low bits are the slot."""
    cap = 1024
    while cap < len(keys):
        cap *= 2
    table = np.zeros(2 * cap, dtype=np.uint64)
    ids = np.empty(len(keys), dtype=np.int64)
    distinct = np.empty(max(len(keys), 1), dtype=np.uint64)
    n = 0
    for k in range(len(keys)):
        key = keys[k]
        i = np.int64(key & _U(cap - 1))
        while table[2 * i + 1] != 0 and table[2 * i] != key:
            i = (i + 1) & (cap - 1)
        if table[2 * i + 1] != 0:
            ids[k] = np.int64(table[2 * i + 1]) - 1
            continue
        table[2 * i], table[2 * i + 1] = key, _U(n + 1)
        distinct[n] = key
        ids[k] = n
        n += 1
        if 8 * n > 5 * cap:  # grow: reinsert every distinct key so far
            cap *= 2
            table = np.zeros(2 * cap, dtype=np.uint64)
            for d in range(n):
                j = np.int64(distinct[d] & _U(cap - 1))
                while table[2 * j + 1] != 0:
                    j = (j + 1) & (cap - 1)
                table[2 * j], table[2 * j + 1] = distinct[d], _U(d + 1)
    return ids, distinct[:n].copy()


@numba.njit(cache=True)
def ideal_hit_blocks(ids, starts, lookups):
    """IdealCounter's hits over dense ids (kvbench.trace.ideal.ideal_hit_blocks)."""
    hits = np.zeros(len(lookups), dtype=np.int64)
    seen = 0  # ids below it belong to earlier requests (ids are numbered by first appearance)
    for i in range(len(lookups)):
        s, e = starts[i], starts[i + 1]
        h = 0
        while h < lookups[i] and ids[s + h] < seen:
            h += 1
        hits[i] = h
        for k in range(s, e):
            seen = max(seen, ids[k] + 1)
    return hits


@numba.njit(cache=True)
def parent_ids(ids, starts, n_distinct):
    """parent[d] = the id before block d in its request (-1 for a request's first block); where a
    block appears more than once, the last appearance's (chained keys make them all equal)."""
    parent = np.full(n_distinct, -1, dtype=np.int64)
    for i in range(len(starts) - 1):
        before = -1
        for k in range(starts[i], starts[i + 1]):
            parent[ids[k]] = before
            before = ids[k]
    return parent
