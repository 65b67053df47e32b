// The engine's rows as arrays and back (ngramrl/core/rows.py: committed_rows, batch_ranks,
// DraftBatch.truncated, DraftBatch.lists, DraftBatch.for_target): what a vLLM step hands the
// proposer (one Python list of sampled tokens per row) becomes the drafting core's flat arrays in
// one pass, and the drafts become vLLM's lists in one pass. After a forward has flushed the caches
// each NumPy call costs 10-30 us at a few hundred rows, so a step's array work is done here, not
// as a dozen NumPy calls.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace ngramrl {

using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

// After a forward every list, its item array and its ints are cache misses, each found through the
// one before: a pass over many lists hints the lists kListsAhead ahead, the item arrays of the
// lists 2 * kItemsAhead ahead and the ints of those kItemsAhead ahead, so the misses of several
// lists overlap instead of following each other.
constexpr int64_t kListsAhead = 16, kItemsAhead = 4;

inline void hint_items(PyObject* list) { __builtin_prefetch(reinterpret_cast<PyListObject*>(list)->ob_item); }

inline void hint_ints(PyObject* list) {
    PyObject* const* items = reinterpret_cast<PyListObject*>(list)->ob_item;
    for (Py_ssize_t t = 0, size = Py_SIZE(list); t < size; ++t) __builtin_prefetch(items[t]);
}

// Row i's token list, checked to be a list (a TypeError sends the caller to the general path).
inline PyObject* row_list(const py::list& lists, int64_t i, const char* where) {
    PyObject* row = PyList_GET_ITEM(lists.ptr(), i);
    if (!PyList_Check(row)) throw py::type_error(std::string(where) + ": row " + std::to_string(i) + " is not a list");
    return row;
}

// The lists' rows ``at[0..n)`` flat as int32 into ``out`` (offsets ``off``, computed already).
inline void copy_tokens(const py::list& lists, const int64_t* at, int64_t n, const int64_t* off, int32_t* out,
                        const char* where) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + 2 * kItemsAhead < n) hint_items(PyList_GET_ITEM(lists.ptr(), at[i + 2 * kItemsAhead]));
        if (i + kItemsAhead < n) hint_ints(PyList_GET_ITEM(lists.ptr(), at[i + kItemsAhead]));
        PyObject* row = PyList_GET_ITEM(lists.ptr(), at[i]);
        for (int64_t t = 0; t < off[i + 1] - off[i]; ++t) {
            const long value = PyLong_AsLong(PyList_GET_ITEM(row, t));
            if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
            if (value < INT32_MIN || value > INT32_MAX)
                throw py::value_error(std::string(where) + ": token " + std::to_string(value) + " of row " +
                                      std::to_string(at[i]) + " is not an int32");
            out[off[i] + t] = static_cast<int32_t>(value);
        }
    }
}

// A tuple's or a list's items (borrowed) and their count.
inline PyObject* const* sequence_items(const py::handle& seq, Py_ssize_t& n, const char* what) {
    if (PyTuple_Check(seq.ptr()) || PyList_Check(seq.ptr())) {
        n = PySequence_Fast_GET_SIZE(seq.ptr());
        return PySequence_Fast_ITEMS(seq.ptr());
    }
    throw py::type_error(std::string("batch_ranks: ") + what + " are not a tuple or a list");
}

// ngramrl.core.rows.batch_ranks: a step's ids as ranks, (ranks, misses, entered, left). An id
// that is the very object at its position in the last step's ids keeps its rank there; the others
// (``entered``, their positions) are looked up in ``known``, ``missing`` and listed in ``misses``
// where absent; ``left``: the last step's ids that are nowhere in this step's ids (by identity).
// After a forward every id, dict entry and rank object is a cache miss (about 200 ns an id at 256
// rows), and a batch keeps most ids where they were: only its two pointer arrays are read for those.
inline py::tuple batch_ranks(const py::handle& ids, const py::dict& known, int64_t missing, const py::handle& last_ids,
                             const I64& last_ranks) {
    Py_ssize_t n = 0, n_last = 0;
    PyObject* const* now = sequence_items(ids, n, "the ids");
    PyObject* const* before = sequence_items(last_ids, n_last, "the last ids");
    if (last_ranks.size() != n_last)
        throw py::value_error("batch_ranks: " + std::to_string(last_ranks.size()) + " last ranks for " +
                              std::to_string(n_last) + " last ids");
    const int64_t* kept = last_ranks.data();
    py::array_t<int64_t> ranks(n);
    int64_t* out = ranks.mutable_data();
    py::list misses, entered;
    std::vector<PyObject*> came;
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (i < n_last && now[i] == before[i]) {
            out[i] = kept[i];
            continue;
        }
        entered.append(py::int_(i));
        came.push_back(now[i]);
        PyObject* value = PyDict_GetItemWithError(known.ptr(), now[i]);
        if (value == nullptr) {
            if (PyErr_Occurred()) throw py::error_already_set();
            out[i] = missing;
            misses.append(py::int_(i));
            continue;
        }
        const long long rank = PyLong_AsLongLong(value);
        if (rank == -1 && PyErr_Occurred()) throw py::error_already_set();
        out[i] = rank;
    }
    std::sort(came.begin(), came.end());
    py::list left;
    for (Py_ssize_t i = 0; i < n_last; ++i)
        if (!(i < n && now[i] == before[i]) && !std::binary_search(came.begin(), came.end(), before[i]))
            left.append(py::reinterpret_borrow<py::object>(before[i]));
    return py::make_tuple(ranks, misses, entered, left);
}

// ngramrl.core.rows.committed_rows: the rows with an arrival rank (>= 0) and sampled tokens, in
// arrival order, as (index, ranks, tokens, offsets, ks, accepted, rows with room, in batch order,
// each row's num_tokens, the gaps). Row r of the last step (rank sent_ranks[r]) was sent
// sent_offsets[r + 1] - sent_offsets[r] draft tokens and had sent_num_tokens[r] tokens then (none
// given: no gaps looked for); a row now holding more before its sampled tokens is a gap
// (row, sent_num_tokens, its tokens before this step's). ends[i] (none given: max_model_len for
// every row): the tokens row i's request may reach.
inline py::tuple committed_rows(const py::list& sampled, const I64& arrival, const I64& num_tokens, int64_t max_model_len,
                                int32_t k, const I64& sent_ranks, const I64& sent_offsets, const I64& sent_num_tokens,
                                const I64& ends) {
    const int64_t n = arrival.size(), sent = sent_ranks.size();
    if (ends.size() != 0 && ends.size() != n)
        throw py::value_error("committed_rows: " + std::to_string(ends.size()) + " request ends for " +
                              std::to_string(n) + " rows");
    const int64_t* end = ends.size() != 0 ? ends.data() : nullptr;
    const bool gaps_known = sent_num_tokens.size() == sent && sent > 0;
    if (sent_num_tokens.size() != 0 && sent_num_tokens.size() != sent)
        throw py::value_error("committed_rows: " + std::to_string(sent_num_tokens.size()) + " sent token counts for " +
                              std::to_string(sent) + " sent ranks");
    if (static_cast<int64_t>(PyList_GET_SIZE(sampled.ptr())) != n)
        throw py::value_error("committed_rows: " + std::to_string(PyList_GET_SIZE(sampled.ptr())) +
                              " rows of sampled tokens for " + std::to_string(n) + " arrival ranks");
    if (num_tokens.size() < n)
        throw py::value_error("committed_rows: " + std::to_string(num_tokens.size()) + " token counts for " +
                              std::to_string(n) + " rows");
    if (sent_offsets.size() != sent + 1)
        throw py::value_error("committed_rows: " + std::to_string(sent_offsets.size()) + " sent offsets for " +
                              std::to_string(sent) + " sent ranks (one more is needed)");
    const int64_t* rank = arrival.data();
    const int64_t* before = sent_ranks.data();
    for (int64_t i = 1; i < sent; ++i)
        if (before[i] <= before[i - 1])
            throw py::value_error("committed_rows: the sent ranks must rise (entry " + std::to_string(i) + ")");
    std::vector<int64_t> chosen;
    chosen.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
        if (i + kListsAhead < n) __builtin_prefetch(PyList_GET_ITEM(sampled.ptr(), i + kListsAhead));
        if (rank[i] >= 0 && PyList_GET_SIZE(row_list(sampled, i, "committed_rows")) > 0) chosen.push_back(i);
    }
    const bool in_order = std::is_sorted(chosen.begin(), chosen.end(),
                                         [&](int64_t a, int64_t b) { return rank[a] < rank[b]; });
    if (!in_order)
        std::stable_sort(chosen.begin(), chosen.end(), [&](int64_t a, int64_t b) { return rank[a] < rank[b]; });
    const int64_t rows = static_cast<int64_t>(chosen.size());
    py::array_t<int64_t> index(rows), ranks(rows), offsets(rows + 1);
    py::array_t<int32_t> ks(rows);
    py::array_t<int64_t> row_tokens(rows);
    py::list gaps;
    int64_t* held = row_tokens.mutable_data();
    const int64_t* held_before = gaps_known ? sent_num_tokens.data() : nullptr;
    int64_t* at = index.mutable_data();
    int64_t* rk = ranks.mutable_data();
    int64_t* off = offsets.mutable_data();
    int32_t* room = ks.mutable_data();
    const int64_t* length = num_tokens.data();
    const int64_t* verified = sent_offsets.data();
    off[0] = 0;
    int64_t accepted = 0, with_room = 0, s = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = chosen[r];
        at[r] = i;
        rk[r] = rank[i];
        const int64_t size = static_cast<int64_t>(PyList_GET_SIZE(PyList_GET_ITEM(sampled.ptr(), i)));
        off[r + 1] = off[r] + size;
        const int64_t left = (end != nullptr ? std::min(end[i], max_model_len) : max_model_len) - length[i] - 1;
        room[r] = static_cast<int32_t>(std::max<int64_t>(INT32_MIN, std::min<int64_t>(k, left)));
        with_room += room[r] > 0;
        held[r] = length[i];
        // Both rank lists rise: one merge. The token after the accepted ones is the target's own.
        while (s < sent && before[s] < rank[i]) ++s;
        if (s < sent && before[s] == rank[i]) {
            if (verified[s + 1] > verified[s]) accepted += size - 1;
            if (held_before != nullptr && length[i] - size > held_before[s])
                gaps.append(py::make_tuple(r, held_before[s], length[i] - size));
        }
    }
    py::array_t<int32_t> tokens(off[rows]);
    copy_tokens(sampled, at, rows, off, tokens.mutable_data(), "committed_rows");
    const bool whole = in_order && rows == n;
    return py::make_tuple(index, ranks, tokens, offsets, ks, accepted, with_room, whole, row_tokens, gaps);
}

// Checked row ranges of a flat batch (offsets rising from 0 to the tokens).
inline void check_offsets(const I64& offsets, int64_t rows, int64_t num_tokens, const char* where) {
    if (offsets.size() != rows + 1)
        throw py::value_error(std::string(where) + ": " + std::to_string(offsets.size()) + " offsets for " +
                              std::to_string(rows) + " rows");
    const int64_t* off = offsets.data();
    if (off[0] != 0 || off[rows] != num_tokens)
        throw py::value_error(std::string(where) + ": offsets must run from 0 to the " + std::to_string(num_tokens) +
                              " tokens");
    for (int64_t i = 0; i < rows; ++i)
        if (off[i] > off[i + 1]) throw py::value_error(std::string(where) + ": offsets fall at row " + std::to_string(i));
}

struct CutRows {
    py::array_t<int32_t> tokens;
    py::array_t<int64_t> offsets;
    py::array_t<double> probs;
    int64_t kept = 0;  // the tokens within keep, before the vocabulary's cut
};

// Each row cut to its first keep[i] tokens and before its first token outside 0..vocab - 1
// (vocab < 0: no bound).
inline CutRows cut_rows(const I32& tokens, const I64& offsets, const F64& probs, const I64& keep, int64_t vocab,
                        const char* where) {
    const int64_t rows = keep.size(), num_tokens = tokens.size();
    check_offsets(offsets, rows, num_tokens, where);
    if (probs.size() != num_tokens)
        throw py::value_error(std::string(where) + ": " + std::to_string(probs.size()) + " probabilities for " +
                              std::to_string(num_tokens) + " tokens");
    const int64_t* off = offsets.data();
    const int64_t* limit_of = keep.data();
    const int32_t* tok = tokens.data();
    const double* prob = probs.data();
    CutRows cut;
    cut.offsets = py::array_t<int64_t>(rows + 1);
    int64_t* o = cut.offsets.mutable_data();
    o[0] = 0;
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t begin = off[i], limit = begin + std::max<int64_t>(0, std::min(limit_of[i], off[i + 1] - begin));
        cut.kept += limit - begin;
        int64_t end = begin;
        while (end < limit && (vocab < 0 || (tok[end] >= 0 && tok[end] < vocab))) ++end;
        o[i + 1] = o[i] + (end - begin);
    }
    cut.tokens = py::array_t<int32_t>(o[rows]);
    cut.probs = py::array_t<double>(o[rows]);
    int32_t* t = cut.tokens.mutable_data();
    double* p = cut.probs.mutable_data();
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t n = o[i + 1] - o[i];
        std::copy(tok + off[i], tok + off[i] + n, t + o[i]);
        std::copy(prob + off[i], prob + off[i] + n, p + o[i]);
    }
    return cut;
}

// vLLM's draft lists, made again out of the ones vLLM has let go of. Each list handed out is
// held here too; at the next call the lists that only this holds (a reference count of one:
// nobody else can see them) are refilled in place instead of new ones being allocated. A new list
// is a cycle-collector allocation: at 1024 rows the 1024 new lists of a step set off a collection
// of the young generation inside every proposer call, more than 100 us, and now and then an older
// generation's, tens of milliseconds (allocations net of deallocations start one, and a step's
// new lists come before the last step's are freed). A refilled list also frees its old ints just
// before the new ones are made, so the new ints take the blocks just freed, in the caches. A list
// vLLM still holds after ``kMaxAge`` calls is let go of (no longer recycled).
class DraftLists {
public:
    static constexpr uint32_t kMaxAge = 4;

    DraftLists() = default;
    DraftLists(const DraftLists&) = delete;
    DraftLists& operator=(const DraftLists&) = delete;
    ~DraftLists() { release(); }

    // The lists held at the start of a call that only this holds, ready to refill; the others
    // stay held unless too old.
    void collect() {
        ++calls_;
        size_t kept = 0;
        for (size_t i = 0; i < held_.size(); ++i) {
            if (i + kListsAhead < held_.size()) __builtin_prefetch(held_[i + kListsAhead].list);
            const Held h = held_[i];
            if (Py_REFCNT(h.list) == 1)
                spare_.push_back(h.list);
            else if (calls_ - h.call > kMaxAge)
                Py_DECREF(h.list);
            else
                held_[kept++] = h;
        }
        held_.resize(kept);
    }

    // A list of ``n`` items, all NULL (to be set, as after PyList_New): a spare one emptied, or a
    // new one, untracked by the cycle collector (lists of ints cannot be part of a cycle, and
    // vLLM holds them past the step: tracked, every collection would traverse them).
    PyObject* take(Py_ssize_t n) {
#ifndef Py_GIL_DISABLED
        while (!spare_.empty()) {
            const size_t last = spare_.size() - 1;  // the spares go from the back: hint the next ones
            if (last >= static_cast<size_t>(2 * kItemsAhead)) hint_items(spare_[last - 2 * kItemsAhead]);
            if (last >= static_cast<size_t>(kItemsAhead)) hint_ints(spare_[last - kItemsAhead]);
            PyObject* list = spare_.back();
            spare_.pop_back();
            if (refill(list, n)) {
                ++refilled_;
                return list;
            }
        }
#endif
        PyObject* list = PyList_New(n);
        if (list == nullptr) throw py::error_already_set();
        PyObject_GC_UnTrack(list);
        return list;
    }

    // ``list`` goes to vLLM: held here too, from this call on.
    void hand_out(PyObject* list) {
        Py_INCREF(list);
        held_.push_back(Held{list, calls_});
    }

    // The spares this call did not need are let go of.
    void end_call() {
        for (PyObject* list : spare_) Py_DECREF(list);
        spare_.clear();
    }

    size_t held() const { return held_.size(); }
    int64_t refilled() const { return refilled_; }

    void release() {
        end_call();
        for (const Held& h : held_) Py_DECREF(h.list);
        held_.clear();
    }

private:
    struct Held {
        PyObject* list;
        uint32_t call;
    };
    std::vector<Held> held_;
    std::vector<PyObject*> spare_;
    uint32_t calls_ = 0;
    int64_t refilled_ = 0;

    // ``list`` (only this holds it) emptied and sized to ``n`` NULL items, as list_resize would;
    // false (the list let go of) where its items are not all ints: freeing anything else may
    // run code, which must not see the list half made.
    static bool refill(PyObject* list, Py_ssize_t n) {
        PyListObject* l = reinterpret_cast<PyListObject*>(list);
        const Py_ssize_t size = Py_SIZE(list);
        for (Py_ssize_t i = 0; i < size; ++i)
            if (!PyLong_CheckExact(l->ob_item[i])) {
                Py_DECREF(list);
                return false;
            }
        for (Py_ssize_t i = 0; i < size; ++i) Py_DECREF(l->ob_item[i]);
        Py_SET_SIZE(list, 0);
        if (n > l->allocated) {
            PyObject** items = static_cast<PyObject**>(PyMem_Realloc(l->ob_item, static_cast<size_t>(n) * sizeof(PyObject*)));
            if (items == nullptr) {
                Py_DECREF(list);
                return false;
            }
            l->ob_item = items;
            l->allocated = n;
        }
        for (Py_ssize_t i = 0; i < n; ++i) l->ob_item[i] = nullptr;
        Py_SET_SIZE(list, n);
        return true;
    }
};

// ``size`` lists, list positions[i] holding row rows[i] (rows == nullptr: row i) of the flat
// tokens (a later entry for the same position wins), the others empty, each its own object (vLLM
// trims them in place). Each list is made once (``recycled``: out of the lists vLLM let go of,
// DraftLists), and is not tracked by Python's cycle collector: lists of ints cannot be part of a
// cycle, and vLLM holds them past the step, so tracked they would be traversed by every
// collection until they die (at 1024 rows the collections inside the proposer's call, set off by
// these allocations, took about 1 ms per step). Each token is a fresh int: after a forward the
// caches are cold, and a step's fresh ints come from the allocator's pools in sequence, where ints
// shared per token id are scattered over a vocabulary's worth of objects, a cache miss per token
// (target_rows at 256 in flight in the step-time replay: 149 us with shared ints, 63-66 us with
// fresh ones; docs/native.md).
inline py::list lists_of(int64_t size, const I64& positions, const int64_t* rows, const int32_t* tok,
                         const int64_t* off, int64_t num_offsets, int64_t num_tokens, const char* where,
                         DraftLists* recycled) {
    const int64_t n = positions.size();
    if (size < 0) throw py::value_error(std::string(where) + ": size " + std::to_string(size) + " < 0");
    const int64_t* at = positions.data();
    std::vector<int64_t> row_at(static_cast<size_t>(size), -1);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t row = rows ? rows[i] : i;
        if (at[i] < 0 || at[i] >= size)
            throw py::value_error(std::string(where) + ": position " + std::to_string(at[i]) + " (entry " +
                                  std::to_string(i) + ") outside 0.." + std::to_string(size - 1));
        if (row < 0 || row + 1 >= num_offsets || off[row] < 0 || off[row] > off[row + 1] || off[row + 1] > num_tokens)
            throw py::value_error(std::string(where) + ": row " + std::to_string(row) + " (entry " +
                                  std::to_string(i) + ") has no token range in " + std::to_string(num_offsets) +
                                  " offsets over " + std::to_string(num_tokens) + " tokens");
        row_at[at[i]] = row;
    }
    DraftLists fresh;  // without recycling: new lists, nothing held past the call
    DraftLists& lists = recycled ? *recycled : fresh;
    lists.collect();
    struct EndCall {
        DraftLists& lists;
        ~EndCall() { lists.end_call(); }
    } end_call{lists};
    PyObject* out = PyList_New(size);
    if (out == nullptr) throw py::error_already_set();
    py::list result = py::reinterpret_steal<py::list>(out);
    for (int64_t p = 0; p < size; ++p) {
        const int64_t row = row_at[p];
        const int64_t begin = row < 0 ? 0 : off[row], end = row < 0 ? 0 : off[row + 1];
        PyObject* list = lists.take(end - begin);
        for (int64_t t = begin; t < end; ++t) {
            PyObject* value = PyLong_FromLong(tok[t]);
            if (value == nullptr) {
                Py_DECREF(list);  // (its items not set yet are NULL, which freeing a list skips)
                throw py::error_already_set();
            }
            PyList_SET_ITEM(list, t - begin, value);
        }
        PyList_SET_ITEM(out, p, list);
        if (recycled) recycled->hand_out(list);
    }
    return result;
}

// DraftBatch.truncated, as (tokens, offsets, probs).
inline py::tuple truncate_rows(const I32& tokens, const I64& offsets, const F64& probs, const I64& keep, int64_t vocab) {
    CutRows cut = cut_rows(tokens, offsets, probs, keep, vocab, "truncate_rows");
    return py::make_tuple(cut.tokens, cut.offsets, cut.probs);
}

// DraftBatch.lists.
inline py::list draft_lists(int64_t size, const I64& positions, const I64& rows, const I32& tokens, const I64& offsets) {
    if (rows.size() != positions.size())
        throw py::value_error("draft_lists: " + std::to_string(positions.size()) + " positions but " +
                              std::to_string(rows.size()) + " rows");
    return lists_of(size, positions, rows.data(), tokens.data(), offsets.data(), offsets.size(), tokens.size(),
                    "draft_lists", nullptr);
}

// DraftBatch.for_target: truncated, then row i's draft in list positions[i] of ``size``, as
// (tokens, offsets, probs, lists, tokens within keep); the lists made of ``recycled``'s where given.
inline py::tuple target_rows(const I32& tokens, const I64& offsets, const F64& probs, const I64& keep, int64_t vocab,
                             int64_t size, const I64& positions, DraftLists* recycled) {
    if (positions.size() != keep.size())
        throw py::value_error("for_target: " + std::to_string(positions.size()) + " positions for " +
                              std::to_string(keep.size()) + " rows");
    CutRows cut = cut_rows(tokens, offsets, probs, keep, vocab, "for_target");
    py::list lists = lists_of(size, positions, nullptr, cut.tokens.data(), cut.offsets.data(), cut.offsets.size(),
                              cut.tokens.size(), "for_target", recycled);
    return py::make_tuple(cut.tokens, cut.offsets, cut.probs, lists, cut.kept);
}

}  // namespace ngramrl
