"""Peak memory of one D2P2 step on a model with a 1,000,000-parameter layer.

The model is `Dense(1000)` on 1000 inputs (1,001,000 parameters). A dense
Gaussian projection of its kernel at ratio 0.3 would be a 10^6 x 3*10^5
matrix (1.2 TB in float32); tfdpx never builds it. The SRHT (mode O) works in
O(d') memory; the Gaussian projection (mode N) is generated in blocks of at
most `projections.BLOCK_ENTRIES` entries, and is O(d p) in time, so it is
measured here at a small ratio.

Prints the process's peak resident memory (ru_maxrss) after each phase.

Usage:
  python -m benchmarks.memory_d2p2 [--projection srht|gaussian|none]
      [--ratio 0.3] [--batch 32]
"""

import argparse
import resource
import time

import numpy as np
import tensorflow as tf

import tfdpx


def peak_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--projection', default='srht')
  parser.add_argument('--ratio', type=float, default=0.3)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--steps', type=int, default=2)
  args = parser.parse_args()

  model = tf.keras.Sequential([tf.keras.layers.Dense(1000,
                                                     input_shape=(1000,))])
  params = model.count_params()
  privatizer = tfdpx.privatizers.d2p2(
      1.0, projection=args.projection, projection_ratio=args.ratio,
      back_projection='unbiased')
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer,
                                expected_batch_size=args.batch,
                                learning_rate=0.1, noise_seed=0)
  variables = model.trainable_variables
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(args.batch, 1000)), tf.float32)
  y = tf.constant(rng.normal(size=(args.batch, 1000)), tf.float32)

  @tf.function
  def step(x, y):
    def example_grads(example):
      xi, yi = example
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xi[None]) - yi[None]))
      return tape.gradient(loss, variables)
    grads = tf.vectorized_map(example_grads, (x, y))
    optimizer.apply_gradients(zip(optimizer.privatize(grads, variables),
                                  variables))

  print(f'parameters: {params}; projection={args.projection} '
        f'ratio={args.ratio} batch={args.batch}')
  print(f'peak RSS after building the model: {peak_mib():.0f} MiB')
  per_example = args.batch * params * 4 / 2**20
  print(f'per-example gradients alone: {per_example:.0f} MiB')
  for i in range(args.steps):
    start = time.time()
    step(x, y)
    print(f'step {i}: {time.time() - start:.1f} s, peak RSS '
          f'{peak_mib():.0f} MiB')
  if args.projection != 'none':
    p = privatizer.projected_dim((1000, 1000))
    print(f'a dense projection of the kernel would be 1000000 x {p} floats '
          f'= {1e6 * p * 4 / 2**30:.0f} GiB')


if __name__ == '__main__':
  main()
