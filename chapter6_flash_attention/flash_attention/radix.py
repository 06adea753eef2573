"""A radix tree of cached prompt prefixes over the paged KV cache (SGLang's RadixAttention idea).

Requests that share a prefix (a system prompt, a few-shot preamble, the earlier turns of a chat)
can share its KV blocks instead of recomputing them. The tree maps token ids to the KV blocks
that hold them; a new request looks up its longest cached prefix and prefills only the rest.

It works in whole blocks of block_size tokens, as vLLM's and SGLang's paged prefix caches do: a
partly filled block is still being written by its owner, so only full blocks are shared. Every
edge is a run of whole blocks; a node's children are keyed by their first block, so two children
may start with the same token when their first blocks differ later.

Why the work is split the way it is:
- insert and evict stay here, in Python. They are rare next to lookups (once per finished
  prefill, once per memory shortage), they chase pointers through a small tree, allocate and free
  nodes, split edges and keep LRU order: control flow and allocation, which a GPU does badly and
  which is easy to get right, and to read, in Python.
- the lookup goes to the GPU (flash_attention's match_prefix op). Every scheduling step looks up a
  whole batch of requests, each independently: the hot, batched, data-parallel part, and on the
  device it needs no copy of the prompts back to the host. The tree is mirrored into flat arrays
  (csrc/serving/serving.h's RadixTreeView) once per change and reused by every lookup until the
  next.

Recency for eviction is what insert and lock record: a request that uses a matched prefix locks
it for as long as its blocks are read, and that is the access that counts. The GPU lookup alone
leaves no trace on the host, which is what keeps it free of syncs.
"""
import heapq
import itertools

import torch

__all__ = ["RadixCache", "PrefixLock"]


class _Node:
    """An edge of whole blocks and the node it leads to."""
    __slots__ = ("tokens", "blocks", "children", "parent", "last_use", "refs")

    def __init__(self, tokens, blocks, parent):
        self.tokens = tokens      # len(blocks) * block_size token ids
        self.blocks = blocks      # the KV block ids holding them
        self.children = {}        # first block's token ids (a tuple) -> _Node
        self.parent = parent
        self.last_use = 0         # RadixCache's clock at the last insert or lock through here
        self.refs = 0             # live locks whose path runs through here


class PrefixLock:
    """What RadixCache.lock returns: the matched prefix's block ids (and its length in tokens),
    pinned until unlock."""
    __slots__ = ("block_ids", "num_tokens", "_node", "_held")

    def __init__(self, node, block_ids, block_size):
        self.block_ids = block_ids
        self.num_tokens = len(block_ids) * block_size
        self._node = node
        self._held = True


def _device(device):
    """torch.device(device), "cuda" pinned to the current GPU: one mirror per GPU, found again
    whether a caller says "cuda" or "cuda:0"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _ints(values, what):
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(values.shape)}")
        return values.tolist()
    return [int(v) for v in values]


class RadixCache:
    """Cached prefixes in whole KV blocks of `block_size` tokens.

    insert(token_ids, block_ids) adds a finished prefill's blocks; lock(token_ids) pins the
    longest cached prefix of a request for as long as it reads those blocks (unlock releases it);
    match_prefix(...) looks up a batch of requests on any device; evict(num_blocks) frees the
    least recently used unlocked leaves and returns their block ids to the caller's allocator.
    """

    def __init__(self, block_size):
        if int(block_size) < 1:
            raise ValueError(f"RadixCache: block_size is {block_size}; it must be at least 1")
        self.block_size = int(block_size)
        self.root = _Node([], [], None)
        self._clock = itertools.count(1)
        self._mirrors = {}  # device -> the flat arrays of the current tree; emptied by every change

    # -- the tree ----------------------------------------------------------------------------
    def _block(self, tokens, i):
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def _changed(self):
        self._mirrors.clear()

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_blocks(self):
        """How many KV blocks the tree holds."""
        return sum(len(node.blocks) for node in self._nodes())

    def _split(self, node, k):
        """Cut node's edge after its first k blocks; returns the new upper node. Locks through
        `node` run through the upper part too, so it inherits node's count and recency."""
        bs = self.block_size
        upper = _Node(node.tokens[:k * bs], node.blocks[:k], node.parent)
        upper.refs, upper.last_use = node.refs, node.last_use
        node.parent.children[self._block(upper.tokens, 0)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[k * bs:], node.blocks[k:], upper
        upper.children[self._block(node.tokens, 0)] = node
        return upper

    def insert(self, token_ids, block_ids):
        """Cache the whole blocks of token_ids, held in KV blocks block_ids (one id per whole
        block, in order; ids beyond them, such as a partly filled last block, are ignored).

        Returns how many leading blocks were cached already: the tree keeps its own ids for
        those, so the caller frees its duplicates block_ids[:returned]; it adopts the rest, and
        hands them back through evict.
        """
        tokens = _ints(token_ids, "insert: token_ids")
        blocks = _ints(block_ids, "insert: block_ids")
        bs = self.block_size
        whole = len(tokens) // bs
        if len(blocks) < whole:
            raise ValueError(f"insert: {len(tokens)} tokens make {whole} whole blocks of {bs} but only "
                             f"{len(blocks)} block ids were given")
        stamp = next(self._clock)
        node, done = self.root, 0
        while done < whole:
            child = node.children.get(self._block(tokens, done))
            if child is None:
                leaf = _Node(tokens[done * bs:whole * bs], blocks[done:whole], node)
                leaf.last_use = stamp
                node.children[self._block(tokens, done)] = leaf
                self._changed()
                return done
            # the first block matched (it is the key); how many more of the edge do?
            k = 1
            while (k < len(child.blocks) and done + k < whole
                   and child.tokens[k * bs:(k + 1) * bs] == tokens[(done + k) * bs:(done + k + 1) * bs]):
                k += 1
            if k < len(child.blocks):
                child = self._split(child, k)
                self._changed()
            child.last_use = stamp
            node, done = child, done + k
        return whole

    def _longest_prefix(self, tokens, limit):
        """(the deepest node the match reaches, the matched blocks' ids), at most `limit` blocks:
        the block-by-block walk of csrc/serving/serving.h's match_prefix, over the Python tree."""
        bs = self.block_size
        node = reached = self.root
        blocks = []
        while len(blocks) < limit:
            child = node.children.get(self._block(tokens, len(blocks)))
            if child is None:
                break
            reached = child
            for i, block in enumerate(child.blocks):
                at = len(blocks)
                if at == limit or child.tokens[i * bs:(i + 1) * bs] != tokens[at * bs:(at + 1) * bs]:
                    return reached, blocks
                blocks.append(block)
            node = child
        return reached, blocks

    # -- locks and eviction ------------------------------------------------------------------
    def lock(self, token_ids):
        """Pin the longest cached prefix of token_ids against eviction (and mark it used).
        Returns a PrefixLock whose block_ids are the prefix's KV blocks; release it with unlock.
        The node the match ends in is pinned whole, even where the match stops inside its edge."""
        tokens = _ints(token_ids, "lock: token_ids")
        node, blocks = self._longest_prefix(tokens, len(tokens) // self.block_size)
        stamp = next(self._clock)
        pinned = node
        while pinned is not self.root:
            pinned.refs += 1
            pinned.last_use = stamp
            pinned = pinned.parent
        return PrefixLock(node, blocks, self.block_size)

    def unlock(self, handle):
        """Release a lock from lock(); its blocks may be evicted again once no lock holds them."""
        if not handle._held:
            raise ValueError("unlock: this PrefixLock was released already")
        handle._held = False
        node = handle._node
        while node is not self.root:
            node.refs -= 1
            node = node.parent

    def evict(self, num_blocks):
        """Free at least num_blocks blocks, if that many are unlocked: whole leaves, least
        recently used first (a leaf's parent becomes a candidate once its last child is gone).
        Returns the freed block ids (more than asked when a leaf is longer than needed, fewer when
        the rest is locked)."""
        tie = itertools.count()  # equal stamps: any order, but never compare nodes
        heap = [(node.last_use, next(tie), node) for node in self._nodes()
                if node is not self.root and not node.children and node.refs == 0]
        heapq.heapify(heap)
        freed = []
        while len(freed) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._block(leaf.tokens, 0)]
            freed.extend(leaf.blocks)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_use, next(tie), parent))
        if freed:
            self._changed()
        return freed

    # -- lookup ------------------------------------------------------------------------------
    def flat_tree(self, device="cpu"):
        """The tree as csrc/serving/serving.h's RadixTreeView arrays on `device`: (tokens,
        token_start, span_blocks, block_start, block_ids, child_start, child_count, child_index).
        Built on the host once per change to the tree and copied once per device; node 0 is the
        root, and every node's children are sorted by their first block (by first token, then the
        rest)."""
        device = _device(device)
        if device not in self._mirrors:
            cpu = torch.device("cpu")
            if cpu not in self._mirrors:
                self._mirrors[cpu] = self._flatten()
            self._mirrors[device] = tuple(a.to(device) for a in self._mirrors[cpu])
        return self._mirrors[device]

    def _flatten(self):
        tokens, token_start, span_blocks, block_start, block_ids = [], [], [], [], []
        child_start, child_count, child_index = [], [], []
        order = [self.root]  # breadth first: a node's id is its place here
        for node in order:   # grows while it is walked
            token_start.append(len(tokens))
            tokens += node.tokens
            span_blocks.append(len(node.blocks))
            block_start.append(len(block_ids))
            block_ids += node.blocks
            child_start.append(len(child_index))
            child_count.append(len(node.children))
            for key in sorted(node.children):
                child_index.append(len(order))
                order.append(node.children[key])
        int32, int64 = torch.int32, torch.int64
        return (torch.tensor(tokens, dtype=int32), torch.tensor(token_start, dtype=int64),
                torch.tensor(span_blocks, dtype=int32), torch.tensor(block_start, dtype=int64),
                torch.tensor(block_ids, dtype=int32), torch.tensor(child_start, dtype=int64),
                torch.tensor(child_count, dtype=int32), torch.tensor(child_index, dtype=int32))

    @staticmethod
    def _batch(token_ids_batch, lengths):
        """(queries int32 (requests, width), lengths int32 (requests,)) from a 2-D tensor or a
        list of token id lists (padded with zeros; the lengths say where each ends)."""
        if isinstance(token_ids_batch, torch.Tensor):
            queries = token_ids_batch
            if queries.dim() != 2:
                raise ValueError(f"match_prefix: token_ids_batch must be 2-D (requests, max_len), got shape "
                                 f"{tuple(queries.shape)}")
            if lengths is None:
                lengths = torch.full((queries.shape[0],), queries.shape[1], dtype=torch.int32, device=queries.device)
        else:
            rows = [_ints(row, "match_prefix: a request") for row in token_ids_batch]
            width = max((len(row) for row in rows), default=0)
            queries = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32)
            queries = queries.reshape(len(rows), width)
            if lengths is None:
                lengths = [len(row) for row in rows]
        return queries.to(torch.int32), torch.as_tensor(lengths).to(queries.device, torch.int32)

    def match_prefix(self, token_ids_batch, lengths=None, *, device=None, max_match_blocks=None):
        """The longest cached prefix of every request, in whole blocks, by the match_prefix op.

        token_ids_batch: int (requests, max_len) tensor of token ids (they must fit int32, which
        the op takes), or a list of token id lists; lengths:
        each request's length (default: the whole row, or each list's length). device: where the
        lookup runs (default: the tensor's device, the CPU for lists); the tree's mirror is copied
        there once per change. max_match_blocks: the width of matched_blocks (default max_len //
        block_size). Returns (matched_tokens int32 (requests,), a multiple of block_size;
        matched_blocks int32 (requests, max_match_blocks), the matched prefix's KV block ids,
        then -1).
        """
        queries, lens = self._batch(token_ids_batch, lengths)
        device = queries.device if device is None else _device(device)
        queries, lens = queries.to(device), lens.to(device)
        if max_match_blocks is None:
            max_match_blocks = queries.shape[1] // self.block_size
        return torch.ops.flash_attention.match_prefix(*self.flat_tree(device), self.block_size, queries, lens,
                                                      max_match_blocks)

    def match_prefix_reference(self, token_ids, length=None, max_match_blocks=None):
        """One request's match by a walk over the Python tree (for tests): (matched_tokens, the
        matched blocks' ids as a list)."""
        tokens = _ints(token_ids, "match_prefix_reference: token_ids")
        if length is not None:
            tokens = tokens[:length]
        limit = len(tokens) // self.block_size
        if max_match_blocks is not None:
            limit = min(limit, max_match_blocks)
        _, blocks = self._longest_prefix(tokens, limit)
        return len(blocks) * self.block_size, blocks
