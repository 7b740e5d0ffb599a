"""The local lab that both the benchmarks and the tests run on: a data plane on 127.0.0.1
(simulated replicas, a real HAProxy, a stand-in agent), the overlay in network namespaces, a
peer router to measure beside, a sampler, and the wait they poll with."""
