// Precompiled header for targets that use LibTorch: compiling torch/torch.h once saves minutes
// per build on small machines.
#pragma once
#include <torch/torch.h>
