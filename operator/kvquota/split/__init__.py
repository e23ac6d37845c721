"""How a pool-wide quota is divided over the ready engines: the even split
(`capacity`), and the demand-driven one (`rebalance`, pure; `demand`, the state
between poll rounds)."""
