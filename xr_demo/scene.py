"""The 3-D scene: procedural geometry (a checkered ground, spheres, boxes, pillars, a torus),
a few materials, a sun, fog, and a camera path. Pure numpy, no GPU: the renderer uploads
`Scene.vertices` / `Scene.indices` once and pushes a `Camera`'s matrices every frame.

Conventions: right-handed world, y up, metres. Matrices are numpy (4, 4) acting on column
vectors; `Camera.view_proj` maps to WebGPU clip space (y up, depth 0..1; naga flips y for
Vulkan). The camera path is a function of the frame number, not of wall time, so a run is
reproducible frame for frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FAR = 40.0  # metres: the far plane, the background's depth and the depth normalisation
NEAR = 0.1
# Vertex layout: position (3), normal (3), albedo (3), material (1): 40 bytes.
VERTEX_FLOATS = 10
MATTE, GLOSSY, CHECKER, STRIPES = 0.0, 1.0, 2.0, 3.0


# ---- geometry --------------------------------------------------------------------------------

def _mesh(positions: np.ndarray, normals: np.ndarray, indices: np.ndarray,
          albedo: tuple[float, float, float], material: float) -> tuple[np.ndarray, np.ndarray]:
    n = len(positions)
    v = np.empty((n, VERTEX_FLOATS), np.float32)
    v[:, 0:3], v[:, 3:6] = positions, normals
    v[:, 6:9], v[:, 9] = albedo, material
    return v, indices.astype(np.uint32)


def _grid_indices(rows: int, cols: int) -> np.ndarray:
    """Two triangles per cell of a (rows + 1) x (cols + 1) vertex grid."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    a = (r * (cols + 1) + c).ravel()
    b, d = a + 1, a + cols + 1
    return np.stack([a, d, b, b, d, d + 1], 1).ravel()


def sphere(center, radius: float, albedo, material: float, segments: int = 16):
    th, ph = np.meshgrid(np.linspace(0, math.pi, segments + 1),
                         np.linspace(0, 2 * math.pi, 2 * segments + 1), indexing="ij")
    n = np.stack([np.sin(th) * np.cos(ph), np.cos(th), np.sin(th) * np.sin(ph)], -1).reshape(-1, 3)
    return _mesh(np.asarray(center) + radius * n, n, _grid_indices(segments, 2 * segments),
                 albedo, material)


def torus(center, major: float, minor: float, albedo, material: float, segments: int = 24):
    u, w = np.meshgrid(np.linspace(0, 2 * math.pi, segments + 1),
                       np.linspace(0, 2 * math.pi, segments // 2 + 1), indexing="ij")
    ring = np.stack([np.cos(u), np.zeros_like(u), np.sin(u)], -1)
    n = (ring * np.cos(w)[..., None] + np.array([0.0, 1.0, 0.0]) * np.sin(w)[..., None])
    p = np.asarray(center) + major * ring + minor * n
    return _mesh(p.reshape(-1, 3), n.reshape(-1, 3), _grid_indices(segments, segments // 2),
                 albedo, material)


def cylinder(center, radius: float, height: float, albedo, material: float,
             segments: int = 16):
    """An upright pillar standing on `center` (its base), sides only plus a top cap."""
    a = np.linspace(0, 2 * math.pi, segments + 1)
    ring = np.stack([np.cos(a), np.zeros_like(a), np.sin(a)], -1)
    base = np.asarray(center, np.float64)
    side = np.concatenate([base + radius * ring, base + radius * ring + [0, height, 0]])
    side_n = np.concatenate([ring, ring])
    idx = []
    for i in range(segments):
        j = i + segments + 1
        idx += [i, j, i + 1, i + 1, j, j + 1]
    top_center = base + [0, height, 0]
    cap = np.concatenate([[top_center], top_center + radius * ring])
    start = len(side)
    for i in range(segments):
        idx += [start, start + 2 + i, start + 1 + i]
    pos = np.concatenate([side, cap])
    nor = np.concatenate([side_n, np.tile([0.0, 1.0, 0.0], (segments + 2, 1))])
    return _mesh(pos, nor, np.asarray(idx), albedo, material)


def box(center, size, albedo, material: float, yaw: float = 0.0):
    """An axis-aligned box rotated by `yaw` about y; flat-shaded (4 vertices per face)."""
    half = np.asarray(size, np.float64) / 2
    faces = []
    for axis in range(3):
        for sign in (-1.0, 1.0):
            n = np.zeros(3)
            n[axis] = sign
            u, v = np.zeros(3), np.zeros(3)
            u[(axis + 1) % 3], v[(axis + 2) % 3] = 1.0, 1.0
            corners = [n * half + (su * u + sv * v) * half
                       for su, sv in ((-1, -1), (1, -1), (1, 1), (-1, 1))]
            faces.append((np.array(corners), n))
    c, s = math.cos(yaw), math.sin(yaw)
    rot = np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
    pos = np.concatenate([f[0] for f in faces]) @ rot.T + np.asarray(center)
    nor = np.concatenate([np.tile(f[1], (4, 1)) for f in faces]) @ rot.T
    idx = np.concatenate([np.array([0, 1, 2, 0, 2, 3]) + 4 * i for i in range(6)])
    return _mesh(pos, nor, idx, albedo, material)


def ground(size: float, albedo, material: float = CHECKER):
    h = size / 2
    pos = np.array([[-h, 0, -h], [h, 0, -h], [h, 0, h], [-h, 0, h]], np.float64)
    return _mesh(pos, np.tile([0.0, 1.0, 0.0], (4, 1)), np.array([0, 2, 1, 0, 3, 2]), albedo,
                 material)


@dataclass
class Scene:
    vertices: np.ndarray  # (n, VERTEX_FLOATS) float32
    indices: np.ndarray  # (m,) uint32
    objects: int

    @classmethod
    def build(cls, seed: int = 0) -> Scene:
        """A ground and about twenty objects placed at random (seeded) around the origin,
        none where the camera path runs (radius 7-9 m)."""
        rng = np.random.default_rng(seed)
        palette = [(0.85, 0.25, 0.2), (0.2, 0.55, 0.85), (0.95, 0.75, 0.2), (0.3, 0.75, 0.35),
                   (0.7, 0.4, 0.8), (0.9, 0.9, 0.88), (0.95, 0.5, 0.15)]
        parts = [ground(80.0, (0.55, 0.55, 0.5))]
        placed = 0
        while placed < 22:
            r = rng.uniform(0.0, 16.0)
            if 6.0 < r < 10.0:  # keep the camera's ring free
                continue
            a = rng.uniform(0, 2 * math.pi)
            x, z = r * math.cos(a), r * math.sin(a)
            color = palette[int(rng.integers(len(palette)))]
            material = float(rng.choice([MATTE, GLOSSY, STRIPES], p=[0.45, 0.4, 0.15]))
            kind = int(rng.integers(4))
            if kind == 0:
                rad = rng.uniform(0.4, 1.3)
                parts.append(sphere((x, rad, z), rad, color, material))
            elif kind == 1:
                size = rng.uniform(0.6, 2.0, 3)
                parts.append(box((x, size[1] / 2, z), size, color, material,
                                 yaw=rng.uniform(0, math.pi)))
            elif kind == 2:
                parts.append(cylinder((x, 0, z), rng.uniform(0.2, 0.5), rng.uniform(1.5, 4.0),
                                      color, material))
            else:
                rad = rng.uniform(0.6, 1.2)
                parts.append(torus((x, rad * 0.35 + 0.05, z), rad, rad * 0.35, color, material))
            placed += 1
        vertices, indices, base = [], [], 0
        for v, i in parts:
            vertices.append(v)
            indices.append(i + base)
            base += len(v)
        return cls(np.concatenate(vertices), np.concatenate(indices).astype(np.uint32),
                   len(parts))


# ---- cameras ---------------------------------------------------------------------------------

def look_at(eye: np.ndarray, target: np.ndarray, up=(0.0, 1.0, 0.0)) -> np.ndarray:
    """World -> view matrix; the view looks down -z (OpenGL/OpenXR convention)."""
    f = target - eye
    f = f / np.linalg.norm(f)
    s = np.cross(f, up)
    s = s / np.linalg.norm(s)
    u = np.cross(s, f)
    m = np.eye(4)
    m[0, :3], m[1, :3], m[2, :3] = s, u, -f
    m[:3, 3] = -m[:3, :3] @ eye
    return m


def perspective_fov(left: float, right: float, up: float, down: float,
                    near: float = NEAR, far: float = FAR) -> np.ndarray:
    """View -> clip space from tangent-space field-of-view angles (radians, left and down
    negative, as OpenXR gives them): x right, y UP, depth 0 at near, 1 at far: WebGPU's
    convention, which the WGSL shaders use; naga's SPIR-V flips y for Vulkan itself."""
    tl, tr, tu, td = math.tan(left), math.tan(right), math.tan(up), math.tan(down)
    w, h = tr - tl, tu - td
    m = np.zeros((4, 4))
    m[0, 0], m[0, 2] = 2 / w, (tr + tl) / w
    m[1, 1], m[1, 2] = 2 / h, (tu + td) / h
    m[2, 2], m[2, 3] = -far / (far - near), -far * near / (far - near)
    m[3, 2] = -1.0
    return m


def perspective(fov_y: float, aspect: float) -> np.ndarray:
    t = math.tan(fov_y / 2)
    return perspective_fov(-math.atan(t * aspect), math.atan(t * aspect), math.atan(t),
                           -math.atan(t))


@dataclass
class Camera:
    view: np.ndarray  # world -> view
    proj: np.ndarray  # view -> clip

    @property
    def view_proj(self) -> np.ndarray:
        return self.proj @ self.view

    @property
    def position(self) -> np.ndarray:
        return np.linalg.inv(self.view)[:3, 3]


def rig(frame: int, fps: float = 72.0) -> np.ndarray:
    """The moving camera rig's pose (view -> world) at a frame: an orbit of radius 8 m around
    the scene, one turn in 40 s, bobbing in height and looking slightly inward and down."""
    t = frame / fps
    a = 2 * math.pi * t / 40.0
    eye = np.array([8.0 * math.cos(a), 1.7 + 0.5 * math.sin(2 * math.pi * t / 7.0),
                    8.0 * math.sin(a)])
    target = np.array([2.5 * math.cos(a + 0.9), 0.6, 2.5 * math.sin(a + 0.9)])
    return np.linalg.inv(look_at(eye, target))


def desktop_camera(frame: int, aspect: float = 1.0, fov_y: float = math.radians(70)) -> Camera:
    return Camera(np.linalg.inv(rig(frame)), perspective(fov_y, aspect))


def pose_matrix(position, orientation_xyzw) -> np.ndarray:
    """An OpenXR pose (position, unit quaternion x y z w) as a 4x4 matrix (view -> space)."""
    x, y, z, w = orientation_xyzw
    m = np.eye(4)
    m[:3, :3] = [[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                 [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                 [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]]
    m[:3, 3] = position
    return m


def xr_camera(frame: int, eye_pose: np.ndarray, fov: tuple[float, float, float, float]
              ) -> Camera:
    """An OpenXR eye: its pose relative to the head (the caller subtracts the head's position
    in the LOCAL space, so the rig sets where the head is), carried by the moving rig (so the
    headset wearer rides the same path as the desktop camera), with its asymmetric field of
    view."""
    carrier = rig(frame)
    world_from_eye = carrier @ eye_pose
    return Camera(np.linalg.inv(world_from_eye), perspective_fov(*fov))


# ---- shaders ---------------------------------------------------------------------------------

SCENE_WGSL = f"""
// The scene pass: two colour targets (the shaded image, and linear depth in metres along the
// view axis, which the network learns to predict) and a depth buffer.
struct Frame {{
    view_proj: mat4x4<f32>,
    view_row_z: vec4<f32>,   // the view matrix's third row: view-space z = dot(row, pos)
    eye: vec4<f32>,          // camera position; w = time in seconds
    sun: vec4<f32>,          // direction towards the sun; w = fog density
}};
var<immediate> frame: Frame;

struct VIn {{
    @location(0) position: vec3<f32>,
    @location(1) normal: vec3<f32>,
    @location(2) albedo: vec3<f32>,
    @location(3) material: f32,
}};

struct VOut {{
    @builtin(position) clip: vec4<f32>,
    @location(0) world: vec3<f32>,
    @location(1) normal: vec3<f32>,
    @location(2) albedo: vec3<f32>,
    @location(3) @interpolate(flat) material: u32,
}};

struct FOut {{
    @location(0) color: vec4<f32>,
    @location(1) depth: vec4<f32>,
}};

@vertex fn vs_main(v: VIn) -> VOut {{
    var o: VOut;
    o.clip = frame.view_proj * vec4<f32>(v.position, 1.0);
    o.world = v.position;
    o.normal = v.normal;
    o.albedo = v.albedo;
    o.material = u32(v.material + 0.5);
    return o;
}}

const SKY_TOP = vec3<f32>(0.32, 0.52, 0.85);
const SKY_HORIZON = vec3<f32>(0.78, 0.84, 0.9);

@fragment fn fs_main(v: VOut) -> FOut {{
    let n = normalize(v.normal);
    let to_eye = frame.eye.xyz - v.world;
    let dist = length(to_eye);
    let view_dir = to_eye / dist;
    let sun = normalize(frame.sun.xyz);
    var albedo = v.albedo;
    var shininess = 0.0;
    if (v.material == {int(CHECKER)}u) {{
        // ground: 1 m checkers, finer lines every 0.25 m
        let cell = floor(v.world.xz);
        let parity = (i32(cell.x) + i32(cell.y)) & 1;
        albedo = select(albedo * 0.55, albedo, parity == 0);
        let f = fract(v.world.xz * 4.0);
        if (min(f.x, f.y) < 0.04) {{ albedo = albedo * 0.8; }}
    }} else if (v.material == {int(GLOSSY)}u) {{
        shininess = 48.0;
    }} else if (v.material == {int(STRIPES)}u) {{
        let s = fract(v.world.y * 3.0 + 0.25 * sin(frame.eye.w));
        albedo = select(albedo, vec3<f32>(0.95, 0.95, 0.9), s < 0.5);
        shininess = 12.0;
    }}
    let diffuse = max(dot(n, sun), 0.0);
    let sky = mix(vec3<f32>(0.25, 0.22, 0.2), SKY_TOP, 0.5 + 0.5 * n.y);
    var color = albedo * (0.95 * diffuse * vec3<f32>(1.0, 0.95, 0.85) + 0.45 * sky);
    if (shininess > 0.0) {{
        let h = normalize(sun + view_dir);
        color += vec3<f32>(0.6) * pow(max(dot(n, h), 0.0), shininess) * step(0.0, diffuse);
    }}
    // exponential fog towards the horizon colour: distance shows in the image, as outdoors
    let fog = 1.0 - exp(-frame.sun.w * dist);
    color = mix(color, SKY_HORIZON, clamp(fog, 0.0, 1.0));
    var o: FOut;
    o.color = vec4<f32>(clamp(color, vec3<f32>(0.0), vec3<f32>(1.0)), 1.0);
    let z = -dot(frame.view_row_z, vec4<f32>(v.world, 1.0));
    o.depth = vec4<f32>(z, 0.0, 0.0, 1.0);
    return o;
}}
"""

SKY_CLEAR = (0.55, 0.7, 0.88, 1.0)  # the background: sky, at depth FAR
SUN = np.array([0.45, 0.8, 0.3])
FOG_DENSITY = 0.03


def push_constants(camera: Camera, time_s: float) -> bytes:
    """The `Frame` block of SCENE_WGSL: 112 bytes (push constants guarantee 128)."""
    block = np.zeros(28, np.float32)
    block[0:16] = camera.view_proj.T.ravel()  # WGSL matrices are column-major
    block[16:20] = camera.view[2]
    block[20:23], block[23] = camera.position, time_s
    block[24:27], block[27] = SUN / np.linalg.norm(SUN), FOG_DENSITY
    return block.tobytes()
