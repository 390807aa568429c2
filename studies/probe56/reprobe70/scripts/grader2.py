from emapg.rewards.math import math_reward
import random
random.seed(1)
n = "7" + "".join(random.choice("0123456789") for _ in range(4499))
for L in (10, 300, 1000, 4200, 4400, 4500):
    m = n[:L]
    print(L, "unboxed:", math_reward(f"So the answer is {m}", m), " gold .0:", math_reward(f"\\boxed{{{m}}}", m + ".0"),
          " frac:", math_reward(f"\\boxed{{\\frac{{{m}}}{{1}}}}", m))
