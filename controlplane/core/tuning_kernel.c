/* The per-block loop of controlplane/core/tuning.py's shadow admission, in C.

   The columns are a _Shadow's own typed arrays (parent, num_children, key, tick) and the
   holder counts of the _BlockIds the shadows share; Python owns them, sizes them before
   each call and passes their addresses in a tn_shadow. `tn_admit_i32` / `tn_admit_i64`
   (the columns' int32 or int64 typecode) do for one lookup what _Shadow._admit_each does
   block by block, with the keys Python computed for each reuse level (so the floats are
   the same ones), and lay the lookup's blocks out by run for the heap. Built and loaded
   by controlplane/core/tuning_kernel.py (ctypes). */

#include <stdint.h>

typedef struct {
    void *parent;              /* by id: the block's parent id (int32 or int64) */
    void *num_children;        /* by id: cached blocks whose parent it is (same type) */
    void *holders;             /* by id: the shadows caching it (same type, all shadows') */
    double *key;               /* by id: priority */
    int64_t *tick;             /* by id: the admission that set the key; -1: not cached */
    const double *level_key;   /* by reuse level: this admission's key */
    const int64_t *run_of_level; /* by reuse level: the run its blocks go in, 0..num_runs */
    int64_t num_runs;
    int64_t t;                 /* this admission's tick */
    int64_t *out;              /* out: the lookup's ids by run, each in lookup order */
    int64_t *run_counts;       /* out: each run's number of ids */
    int64_t hits;              /* out: the leading blocks cached before */
    int64_t added;             /* out: the blocks newly cached */
} tn_shadow;

typedef struct {
    const int64_t *ids;        /* the lookup's ids, a chain from the root (id 0) */
    const int64_t *counts;     /* each block's lookups in AccessStats (0: not tracked) */
    int64_t n;
    int64_t cap;               /* the most credits a block earns */
    int64_t missing;           /* the level of a block not tracked */
} tn_lookup;

static inline int64_t level_of(int64_t num_lookups, int64_t cap, int64_t missing) {
    if (!num_lookups) return missing;
    return num_lookups - 1 < cap ? num_lookups - 1 : cap;
}

#define TN_ADMIT(NAME, T)                                                                   \
    void NAME(tn_shadow *sh, const tn_lookup *lk) {                                         \
        T *parent = sh->parent, *num_children = sh->num_children, *holders = sh->holders;   \
        double *key = sh->key;                                                              \
        int64_t *tick = sh->tick, *run_counts = sh->run_counts, *out = sh->out;             \
        const int64_t *ids = lk->ids, *counts = lk->counts, *run_of = sh->run_of_level;     \
        int64_t n = lk->n, hits = 0, up = 0, added = 0;                                     \
        while (hits < n && tick[ids[hits]] >= 0) hits++;                                    \
        for (int64_t r = 0; r < sh->num_runs; r++) run_counts[r] = 0;                       \
        for (int64_t j = 0; j < n; j++) {                                                   \
            int64_t s = ids[j], lv = level_of(counts[j], lk->cap, lk->missing);            \
            if (tick[s] < 0) {                                                              \
                parent[s] = (T)up;                                                          \
                num_children[up]++;                                                         \
                holders[s]++;                                                               \
                added++;                                                                    \
            }                                                                               \
            key[s] = sh->level_key[lv];                                                     \
            tick[s] = sh->t;                                                                \
            run_counts[run_of[lv]]++;                                                       \
            up = s;                                                                         \
        }                                                                                   \
        sh->hits = hits;                                                                    \
        sh->added = added;                                                                  \
        /* a stable partition by run: each run's next place, kept in run_counts meanwhile */ \
        int64_t start = 0;                                                                  \
        for (int64_t r = 0; r < sh->num_runs; r++) {                                        \
            int64_t c = run_counts[r];                                                      \
            run_counts[r] = start;                                                          \
            start += c;                                                                     \
        }                                                                                   \
        for (int64_t j = 0; j < n; j++)                                                     \
            out[run_counts[run_of[level_of(counts[j], lk->cap, lk->missing)]]++] = ids[j];  \
        for (int64_t r = sh->num_runs - 1; r > 0; r--) run_counts[r] -= run_counts[r - 1];  \
    }

TN_ADMIT(tn_admit_i32, int32_t)
TN_ADMIT(tn_admit_i64, int64_t)
