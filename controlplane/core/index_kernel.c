/* The per-event loops of controlplane/core/index.py's BlockIndex, in C.

   The arrays are the index's own numpy arrays (the layout is described there); Python
   owns them, sizes them before each call and passes their addresses. Each function
   does, one key at a time, what the vectorised numpy path does for a whole batch, with
   the same hash, buckets, tags and placement rule, so either path can read what the
   other wrote. Built and loaded by controlplane/core/index_kernel.py (ctypes).

   A growth under way (moved != NULL) keeps the table it left (old_tags, old_ents) until
   each of its buckets has moved into the new one: every call settles a key (moves the old
   buckets of its two candidates) before it probes or places it, so probes and inserts
   only ever see the new table. */

#include <stdint.h>
#include <string.h>

#define BUCKET 8
#define EMPTY 0u

static const uint64_t C1 = 0x9E3779B97F4A7C15ull;
static const uint64_t C3 = 0x94D049BB133111EBull;

typedef struct {
    uint64_t *keys;    /* (cap, 2) */
    uint64_t *parents; /* (cap, 2) */
    uint64_t *mask;    /* (W, cap) word-major */
    uint64_t *tlo;
    uint64_t *thi;
    uint32_t *tags;    /* (nb, 8) */
    int32_t *ents;     /* (nb, 8) */
    int64_t *free_ids; /* free entry ids, a stack */
    int64_t *counts;   /* replicas per agent slot */
    uint32_t *stored;  /* per entry: clock tick when an agent last newly held it */
    int64_t cap;       /* entries allocated (columns of mask) */
    int64_t W;         /* 64-bit words per mask */
    uint64_t shift;    /* 64 - log2(buckets) */
    int64_t nfree;     /* in/out */
    int64_t hw;        /* in/out: entries ever allocated */
    int64_t live;      /* in/out: keys in the table */
    int64_t now;       /* the clock tick kv_add stamps */
    uint64_t s0, s1;   /* the index's secret hash seed */
    uint32_t *old_tags; /* the table a growth under way left: (old_nb, 8) */
    int32_t *old_ents;
    uint8_t *moved;     /* per old bucket: 1 once its keys are in the new table; NULL: no growth under way */
    uint64_t old_shift; /* 64 - log2(old_nb) */
    int64_t old_nb;     /* buckets of the old table */
} kv_index;

static inline uint64_t fmix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 33);
}

/* index.py's _mix: each half mixed on its own with the seed, then combined */
static inline uint64_t mix(const kv_index *x, const uint64_t *k) {
    return fmix(k[0] ^ x->s0) ^ (fmix(k[1] ^ x->s1) * C1);
}

/* the word a key's second bucket is taken from (its first: h itself) */
static inline uint64_t second(uint64_t h) {
    uint64_t h2 = h * C3;
    return h2 ^ (h2 << 29);
}

static inline void buckets(const kv_index *x, uint64_t h, int64_t *b1, int64_t *b2, uint32_t *tag) {
    *b1 = (int64_t)(h >> x->shift);
    *b2 = (int64_t)(second(h) >> x->shift);
    *tag = (uint32_t)(h & 0xFFFFFFFFull) | 1u;
}

/* Old bucket b's keys into the new table (index.py's _move_buckets): the new table's
   buckets are the old ones split by the hash word's next bits, so each key goes to the
   bucket its own word names there, at the slot j it had, which no other key can hold:
   only b's keys map to those buckets, and nothing is placed in them before b moves. */
static void move_bucket(kv_index *x, int64_t b) {
    if (x->moved[b]) return;
    x->moved[b] = 1;
    for (int j = 0; j < BUCKET; j++) {
        const uint32_t tag = x->old_tags[b * BUCKET + j];
        if (tag == EMPTY) continue;
        const int32_t e = x->old_ents[b * BUCKET + j];
        const uint64_t h = mix(x, x->keys + 2 * (int64_t)e);
        const uint64_t word = (int64_t)(h >> x->old_shift) == b ? h : second(h); /* which of its two it sat in */
        const int64_t nb = (int64_t)(word >> x->shift);
        x->tags[nb * BUCKET + j] = tag;
        x->ents[nb * BUCKET + j] = e;
    }
}

/* Before a key is probed or placed during a growth: both its old buckets moved */
static inline void settle(kv_index *x, const uint64_t *k) {
    if (!x->moved) return;
    const uint64_t h = mix(x, k);
    move_bucket(x, (int64_t)(h >> x->old_shift));
    move_bucket(x, (int64_t)(second(h) >> x->old_shift));
}

/* Old buckets [first, last) into the new table (those not moved yet) */
void kv_move(kv_index *x, int64_t first, int64_t last) {
    if (!x->moved) return;
    if (first < 0) first = 0;
    if (last > x->old_nb) last = x->old_nb;
    for (int64_t b = first; b < last; b++) move_bucket(x, b);
}

/* entry id of key k (-1: absent); *loc gets its flat table slot */
static inline int64_t find_one(kv_index *x, const uint64_t *k, int64_t *loc) {
    settle(x, k);
    int64_t b[2];
    uint32_t tag;
    buckets(x, mix(x, k), &b[0], &b[1], &tag);
    for (int i = 0; i < 2; i++) {
        const uint32_t *row = x->tags + b[i] * BUCKET;
        for (int j = 0; j < BUCKET; j++) {
            if (row[j] == tag) {
                int64_t e = x->ents[b[i] * BUCKET + j];
                const uint64_t *ke = x->keys + 2 * e;
                if (ke[0] == k[0] && ke[1] == k[1]) {
                    if (loc) *loc = b[i] * BUCKET + j;
                    return e;
                }
            }
        }
    }
    return -1;
}

static inline int empties(const uint32_t *row) {
    int n = 0;
    for (int j = 0; j < BUCKET; j++) n += row[j] == EMPTY;
    return n;
}

/* put key k into the emptier of its buckets as a new entry; -1 when both are full */
static inline int64_t insert_one(kv_index *x, const uint64_t *k) {
    settle(x, k);
    int64_t b1, b2;
    uint32_t tag;
    buckets(x, mix(x, k), &b1, &b2, &tag);
    uint32_t *r1 = x->tags + b1 * BUCKET, *r2 = x->tags + b2 * BUCKET;
    int64_t b = empties(r2) > empties(r1) ? b2 : b1;
    uint32_t *row = x->tags + b * BUCKET;
    int j = 0;
    while (j < BUCKET && row[j] != EMPTY) j++;
    if (j == BUCKET) return -1;
    int64_t e = x->nfree > 0 ? x->free_ids[--x->nfree] : x->hw++;
    row[j] = tag;
    x->ents[b * BUCKET + j] = (int32_t)e;
    x->keys[2 * e] = k[0];
    x->keys[2 * e + 1] = k[1];
    x->parents[2 * e] = 0;
    x->parents[2 * e + 1] = 0;
    x->live++;
    return e;
}

/* entry ids of n keys (-1 where absent) and their table slots (loc may be NULL) */
void kv_find(kv_index *x, const uint64_t *keys, int64_t n, int64_t *ent, int64_t *loc) {
    for (int64_t i = 0; i < n; i++) {
        ent[i] = x->live ? find_one(x, keys + 2 * i, loc ? loc + i : NULL) : -1;
        if (loc && ent[i] < 0) loc[i] = -1;
    }
}

/* leading keys present, stopping at the first absent one: their entry ids; returns how many */
int64_t kv_prefix(kv_index *x, const uint64_t *keys, int64_t n, int64_t *ent) {
    if (!x->live) return 0;
    for (int64_t i = 0; i < n; i++) {
        ent[i] = find_one(x, keys + 2 * i, NULL);
        if (ent[i] < 0) return i;
    }
    return n;
}

/* Who holds how much of a prefix whose leading entries are ent[0:m) (kv_prefix): for
   every agent slot holding entries 0..i, counts[slot] = i + 1 and tiers[slot * m + i] =
   1 + its tier code (the Tier value). counts has 64 W zeroed slots; rows of tiers past a
   slot's count are left as they were. Returns how many slots hold entry 0. */
int64_t kv_matches(const kv_index *x, const int64_t *ent, int64_t m, int64_t *counts, uint8_t *tiers) {
    const int64_t W = x->W, cap = x->cap;
    uint64_t alive[W];
    int64_t first = 0;
    for (int64_t w = 0; w < W; w++) alive[w] = ~0ull;
    for (int64_t i = 0; i < m; i++) {
        const int64_t e = ent[i];
        uint64_t any = 0;
        for (int64_t w = 0; w < W; w++) {
            uint64_t a = alive[w] & x->mask[w * cap + e];
            alive[w] = a;
            any |= a;
            const uint64_t lo = x->tlo[w * cap + e], hi = x->thi[w * cap + e];
            while (a) {
                const int b = __builtin_ctzll(a);
                const int64_t slot = 64 * w + b;
                counts[slot] = i + 1;
                tiers[slot * m + i] = (uint8_t)(1 + ((lo >> b) & 1) + 2 * ((hi >> b) & 1));
                a &= a - 1;
                first += (i == 0);
            }
        }
        if (!any) break;
    }
    return first;
}

/* The entries agent `slot` holds, ascending, into out (room for `room`, the slot's
   replica count); returns how many there are, which may exceed room (then only the first
   `room` were written). */
int64_t kv_entries_of(const kv_index *x, int64_t slot, int64_t *out, int64_t room) {
    const uint64_t *m = x->mask + (slot >> 6) * x->cap, bit = 1ull << (slot & 63);
    int64_t k = 0;
    for (int64_t e = 0; e < x->hw; e++) {
        if (m[e] & bit) {
            if (k < room) out[k] = e;
            k++;
        }
    }
    return k;
}

/* Agent `slot` holds keys[start:n) in tier code `code` (0-3); parents may be NULL.
   Returns the index of the first key that found both its buckets full (the caller grows
   the table and calls again from there), or n. The caller has made room for n - start
   new entries (cap, free stack) beforehand. */
int64_t kv_add(kv_index *x, const uint64_t *keys, const uint64_t *parents, int64_t start, int64_t n, int64_t slot,
               int64_t code) {
    int64_t w = slot >> 6;
    uint64_t bit = 1ull << (slot & 63);
    uint64_t *m = x->mask + w * x->cap, *lo = x->tlo + w * x->cap, *hi = x->thi + w * x->cap;
    for (int64_t i = start; i < n; i++) {
        const uint64_t *k = keys + 2 * i;
        int64_t e = x->live ? find_one(x, k, NULL) : -1;
        if (e < 0) {
            e = insert_one(x, k);
            if (e < 0) return i;
        }
        if (parents && (parents[2 * i] | parents[2 * i + 1])) { /* a parent "not told" (zero) keeps one known */
            x->parents[2 * e] = parents[2 * i];
            x->parents[2 * e + 1] = parents[2 * i + 1];
        }
        if (!(m[e] & bit)) {
            m[e] |= bit;
            x->counts[slot]++;
            x->stored[e] = (uint32_t)x->now;
        }
        lo[e] = (code & 1) ? (lo[e] | bit) : (lo[e] & ~bit);
        hi[e] = (code & 2) ? (hi[e] | bit) : (hi[e] & ~bit);
    }
    return n;
}

/* Agent `slot` no longer holds these keys; an entry nobody holds is freed. The caller
   has made room on the free stack for n more ids. Returns the replicas removed. */
int64_t kv_remove(kv_index *x, const uint64_t *keys, int64_t n, int64_t slot) {
    int64_t w = slot >> 6, removed = 0;
    uint64_t bit = 1ull << (slot & 63);
    uint64_t *m = x->mask + w * x->cap, *lo = x->tlo + w * x->cap, *hi = x->thi + w * x->cap;
    for (int64_t i = 0; i < n && x->live; i++) {
        int64_t loc;
        int64_t e = find_one(x, keys + 2 * i, &loc);
        if (e < 0 || !(m[e] & bit)) continue;
        m[e] &= ~bit;
        lo[e] &= ~bit;
        hi[e] &= ~bit;
        x->counts[slot]--;
        removed++;
        int held = 0;
        for (int64_t v = 0; v < x->W && !held; v++) held = x->mask[v * x->cap + e] != 0;
        if (!held) {
            x->tags[loc] = EMPTY;
            x->parents[2 * e] = 0;
            x->parents[2 * e + 1] = 0;
            x->free_ids[x->nfree++] = e;
            x->live--;
        }
    }
    return removed;
}
