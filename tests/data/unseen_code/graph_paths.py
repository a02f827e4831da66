"""A compact weighted directed graph with a few classic traversals."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Dict, Hashable, Iterable, List, Optional, Set, Tuple

Node = Hashable
Edge = Tuple[Node, Node, float]


class CycleError(ValueError):
    """Raised when an ordering is requested for a graph that has a cycle."""

    def __init__(self, cycle: List[Node]) -> None:
        self.cycle = cycle
        joined = " -> ".join(str(n) for n in cycle)
        super().__init__(f"graph contains a cycle: {joined}")


class DiGraph:
    """Adjacency-map digraph; edge weights must be non-negative numbers."""

    def __init__(self, edges: Iterable[Edge] = ()) -> None:
        self._out: Dict[Node, Dict[Node, float]] = {}
        for src, dst, weight in edges:
            self.add_edge(src, dst, weight)

    def add_node(self, node: Node) -> None:
        self._out.setdefault(node, {})

    def add_edge(self, src: Node, dst: Node, weight: float = 1.0) -> None:
        if weight < 0:
            raise ValueError(f"negative weight on {src!r}->{dst!r}")
        self.add_node(src)
        self.add_node(dst)
        self._out[src][dst] = float(weight)

    def nodes(self) -> List[Node]:
        return list(self._out)

    def successors(self, node: Node) -> Dict[Node, float]:
        return dict(self._out.get(node, {}))

    def __contains__(self, node: Node) -> bool:
        return node in self._out

    def __len__(self) -> int:
        return len(self._out)

    def reachable(self, start: Node) -> Set[Node]:
        """Breadth-first set of nodes reachable from ``start``."""
        if start not in self._out:
            raise KeyError(start)
        seen = {start}
        queue = deque([start])
        while queue:
            current = queue.popleft()
            for nxt in self._out[current]:
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return seen

    def dijkstra(self, source: Node) -> Tuple[Dict[Node, float],
                                              Dict[Node, Node]]:
        """Return (distance, predecessor) maps for every reachable node."""
        dist: Dict[Node, float] = {source: 0.0}
        prev: Dict[Node, Node] = {}
        frontier = [(0.0, 0, source)]
        tiebreak = 1
        done: Set[Node] = set()
        while frontier:
            d, _, node = heapq.heappop(frontier)
            if node in done:
                continue
            done.add(node)
            for nxt, w in self._out.get(node, {}).items():
                candidate = d + w
                if candidate < dist.get(nxt, float("inf")):
                    dist[nxt] = candidate
                    prev[nxt] = node
                    heapq.heappush(frontier, (candidate, tiebreak, nxt))
                    tiebreak += 1
        return dist, prev

    def topological_order(self) -> List[Node]:
        """Depth-first ordering; raises :class:`CycleError` on a cycle."""
        white, grey, black = 0, 1, 2
        colour = {n: white for n in self._out}
        order: List[Node] = []
        for root in self._out:
            if colour[root] != white:
                continue
            stack = [(root, iter(self._out[root]))]
            colour[root] = grey
            while stack:
                node, children = stack[-1]
                child = next(children, None)
                if child is None:
                    stack.pop()
                    colour[node] = black
                    order.append(node)
                elif colour[child] == grey:
                    path = [n for n, _ in stack]
                    raise CycleError(path[path.index(child):] + [child])
                elif colour[child] == white:
                    colour[child] = grey
                    stack.append((child, iter(self._out[child])))
        order.reverse()
        return order


def rebuild_path(prev: Dict[Node, Node], source: Node,
                 target: Node) -> Optional[List[Node]]:
    """Walk a predecessor map back from ``target``; None if unreachable."""
    if target != source and target not in prev:
        return None
    path = [target]
    while path[-1] != source:
        path.append(prev[path[-1]])
    path.reverse()
    return path


def shortest_path(graph: DiGraph, source: Node,
                  target: Node) -> Tuple[float, Optional[List[Node]]]:
    dist, prev = graph.dijkstra(source)
    return dist.get(target, float("inf")), rebuild_path(prev, source, target)


def reversed_graph(graph: DiGraph) -> DiGraph:
    flipped = DiGraph()
    for node in graph.nodes():
        flipped.add_node(node)
        for nxt, w in graph.successors(node).items():
            flipped.add_edge(nxt, node, w)
    return flipped
