// Bounds on sampling and scoring parameters shared by the configs (YAML) and the services (wire).
#pragma once

namespace lm {

// The smallest softmax temperature accepted anywhere (0 stays greedy decoding where it is
// allowed). Logits are divided by the temperature in fp32, whose largest finite value is ~3.4e38:
// a temperature that underflows (1e-45 is a float denormal) turns logits of ~1e4 in magnitude into
// inf, inf - inf is NaN, and every log-prob with it. 1e-4 keeps logits / temperature below ~1e8,
// thirty orders of magnitude clear of overflow, while a lower temperature would only collapse the
// softmax to a one-hot anyway (greedy, better asked for as 0). Services compare the value as the
// float it travels as, so that float(1e-4) is accepted too.
inline constexpr double kMinTemperature = 1e-4;

// The largest temperature a config accepts (opd-ctl's flags use the same bound): past it every
// distribution a model produces is flattened to uniform, so a larger value is a typo (700 for
// 0.7), not a setting. It also keeps the value far inside the float it travels as.
inline constexpr double kMaxTemperature = 1000;

}  // namespace lm
