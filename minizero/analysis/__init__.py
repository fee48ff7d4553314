"""What the course measures and computes about a run rather than runs: the ledger of the
collectives a step issued (ledger.py, lesson 00), the memory budget of a step
(budget.py, lessons 05-06), the profiler's timeline of a step (timeline.py, lesson 01), the
paper's Table 1 from the real stage code on meta tensors (simulate.py, lesson 05) and the α-β
cost model of collectives and of a step (cost.py, lessons 00, 01, 08), and a run at scale priced
with them (scenario.py, lesson 08). Library code: it imports the stages, never the tools or the
course."""
